"""Every method's hyperparameter defaults, pinned: a default is what produced the method's own
paper's numbers (the defaults rule: where the paper's equation and its released code differ, the
form its hyperparameters were tuned with), and each one says where it comes from
(``setting(..., source=...)``, shown by ``raysim methods NAME``). Changing a default changes
published numbers: this table must be edited with it, on purpose. A method added later must add
its row."""
import dataclasses

import pytest

from raysim.app.catalog import hparam_rows
from raysim.methods import registry

PINNED = {
    'ccst': {'variant': 'image', 'k': 3, 'encoder_path': '', 'decoder_path': ''},
    'central': {},
    'copa': {'frozen_weight': 1.0, 'ibn_fraction': 0.5},
    'csac': {'lam': 0.6,
             'label_smoothing': 0.1,
             'stage1_epochs': 30,
             'stage1_iters_per_epoch': 60,
             'iters_per_epoch': 20,
             'fusion': 'divergence',
             'fusion_distance': 'l2',
             'alignment': 'cross',
             'attention': 'both',
             'discrepancy': 'mmd',
             'retrain_loss': True,
             'layers': (),
             'proj_channels': 32,
             'proj_size': 0,
             'alpha_temperature': 1.0,
             'logit_mmd_weight': 0.0,
             'independent_head_init': True,
             'variant': 'paper'},
    'dapperfl': {'alpha0': 0.9,
                 'alpha_min': 0.1,
                 'epsilon': 0.2,
                 'gamma': 0.01,
                 'rho_levels': (0.0, 0.2, 0.4, 0.6, 0.8),
                 'tier_shares': None,
                 'tier_assignment': 'seeded',
                 'rho': None,
                 'fusion': True,
                 'fuse_from_round': 2,
                 'recovery': 'global',
                 'dar_form': 'l2',
                 'ce_norm': 'batch',
                 'dar_in_finetune': True,
                 'finetune_epochs': 1,
                 'prune_scheme': 'filters',
                 'bn_stats': 'recovered',
                 'official_compat': False},
    'ditto': {'lam': 1.0, 'lam_grid': (0.1, 1.0, 2.0)},
    'elcfs': {'r': 0.01, 'beta': 0.0, 'clip': 100.0, 'bank_fraction': 1.0, 'gamma': 0.0, 'tau': 0.1},
    'fdse': {'lam': 0.1,
             'tau': 0.5,
             'beta': 0.001,
             'gamma': 0.9,
             'G': 2,
             'dw': 3,
             'dw_fc': 1,
             'dse_act': 'relu',
             'con_mode': 'paper',
             'skip_first_round': True,
             'shared_agg': 'consensus',
             'dse_agg': 'attention',
             'adapt_epochs': 5,
             'adapt_lr': 0.0,
             'adapt_batch': 50},
    'fedadg': {'alpha': 0.85,
               'label_smoothing': 0.01,
               'smoothing': 'others',
               'soft_label': 0.7,
               'soft_label_rest': 'zero',
               'disc_features': 'eval',
               'ce_epochs': 3,
               'gd_lr_ratio': 0.7,
               'rp_size': 1024,
               'upload': 'last'},
    'fedavg': {},
    'fedadagrad': {},  # the server optimizer's defaults are the config's (raysim.config.ServerConfig)
    'fedadam': {},
    'fedavgm': {},
    'fedbuff': {},
    'fedasync': {'alpha': 0.6, 'rho': 0.005},
    'fedyogi': {},
    'fedavg_gn': {},
    'fedavg_ln': {},
    'fedavg_mixstyle': {'p': 0.5, 'alpha': 0.1, 'eps': 1e-06},
    'fedavg_rsc': {'drop_f': 0.3333333333333333, 'drop_b': 0.3333333333333333},
    'fedbn': {},
    'feddg_ga': {'step_size': 0.2, 'metric': 'acc', 'centre': False},
    'feddrop': {'rho': 0.6, 'rho_levels': None, 'mask_scope': 'client', 'aggregation': 'all', 'rescale': False},
    'feddyn': {'alpha': 0.01},
    'fedfa': {'p': 0.5, 'momentum': 0.99, 'eps': 1e-06, 'shared_var': 'scalar_code'},
    'fedheal': {'tau': 0.3, 'beta': 0.4},
    'fedmp': {'rho_levels': (0.0, 0.2, 0.4, 0.6, 0.8), 'rho': None, 'prune_stem': False, 'rescale': False},
    'fedprox': {'mu': 0.01},
    'fedsr': {'alpha_l2r': 0.01,
              'alpha_cmi': 0.0005,
              'z_dim': 0,
              'num_samples': 20,
              'l2r': 'norm',
              'reference': 'local',
              'eval_rule': 'sample'},
    'fedwon': {'agc': 'auto',
               'agc_lambda': 0.64,
               'agc_eps': 0.001,
               'agc_small_batch': 4,
               'agc_exclude': 'head',
               'agc_clip_vectors': True,
               'ws': True,
               'ws_eps': 0.0001,
               'ws_unbiased': True,
               'ws_gain_init': 1.0,
               'ws_bias': True,
               'ws_plain_convs': (),
               'lr': 0.0},
    'fixbn': {'switch_frac': 0.5, 'switch_round': 0},
    'fpl': {'tau': 0.02},
    'gfedavg': {'lam': 0.5, 'lr_schedule': 'cosine', 'persist_optimizer': True},
    'gperxan': {'lam': 0.5,
                'lr_schedule': 'cosine',
                'persist_optimizer': True,
                'norm': 'perxan',
                'stages': 'auto',
                'mix': 'softmax',
                'score_init': 'ones',
                'local_bn_score': True,
                'local_plain_bn': False,
                'in_affine_init': 'default'},
    'lg_fedavg': {'global_layers': 2},
    'local': {},
    'moon': {'mu': 1.0, 'tau': 0.5, 'head': 'mlp', 'proj_dim': 256},
    'nefl': {'rho_levels': (0.0, 0.2, 0.4, 0.6, 0.8), 'learnable_step': True},
    'partialfed': {'keep': ('bn', 'head')},
    'powerofchoice': {'d': None, 'variant': 'pow-d'},
    'scaffold': {'eta_g': 1.0, 'option': 'II'},
    'silobn': {},
}


def defaults(name: str) -> dict:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(registry.get(name).Hparams)}


SHIPPED = registry.names()  # at collection, before any test registers a toy method of its own


def test_every_registered_method_has_its_defaults_pinned():
    assert set(PINNED) == set(SHIPPED)


@pytest.mark.parametrize("method", registry.names())
def test_defaults_are_the_pinned_ones(method):
    assert defaults(method) == PINNED[method]


@pytest.mark.parametrize("method", registry.names())
def test_every_default_says_where_it_comes_from(method):
    fields = dataclasses.fields(registry.get(method).Hparams)
    assert [f.name for f in fields if not f.metadata.get("source", "").strip()] == []
    shown = {row[0]: row[3] for row in hparam_rows(registry.get(method))}  # raysim methods NAME's "default from"
    assert shown == {f.name: f.metadata["source"] for f in fields}


# ----------------------------------------------------------------------------- the server's step
# FedAvgM, FedAdagrad, FedAdam and FedYogi are FedAvg with a server optimizer: their defaults are
# the `server:` section's (raysim.core.server_optimizers defines each once; ServerConfig takes them)
SERVER_PINNED = {
    "lr": {"sgd": 1.0, "momentum": 1.0, "adagrad": 0.1, "adam": 0.01, "yogi": 0.01},
    "momentum": 0.9, "betas": (0.9, 0.999), "tau": 1e-3, "form": "code",
}
PAPER_FORM_BETAS = (0.9, 0.99)  # server.form=paper: the paper's text (the code form's are Keras's, which ran)
SERVER_OF = {"fedavg": "sgd", "fedavgm": "momentum", "fedbuff": "momentum", "fedadagrad": "adagrad", "fedadam": "adam", "fedyogi": "yogi"}


@pytest.mark.parametrize("method", list(SERVER_OF))
def test_server_defaults_are_the_pinned_ones(method):
    from raysim.config import ServerConfig
    from raysim.core.server_optimizers import resolve

    for server in (None, ServerConfig()):  # no server section, or the section at its defaults
        opt = resolve(server, registry.get(method).server_optimizer, method)
        assert opt.name == SERVER_OF[method]
        got = {"lr": opt.lr, "momentum": opt.momentum, "betas": opt.betas, "tau": opt.tau, "form": opt.form}
        assert got == {**SERVER_PINNED, "lr": SERVER_PINNED["lr"][opt.name]}


def test_every_server_default_says_where_it_comes_from():
    from raysim.config import ServerConfig

    fields = dataclasses.fields(ServerConfig)
    assert [f.name for f in fields if not f.metadata.get("source", "").strip()] == []
    assert {f.name: f.default for f in fields} == {"optimizer": None, "lr": None, **{
        k: v for k, v in SERVER_PINNED.items() if k != "lr"}, "betas": None}  # None: the form's


@pytest.mark.parametrize("method", ["fedadam", "fedyogi"])
def test_the_paper_form_takes_the_papers_betas_unless_set(method):
    from raysim.config import ServerConfig
    from raysim.core.server_optimizers import resolve

    cls = registry.get(method)
    assert resolve(ServerConfig(form="paper"), cls.server_optimizer, method).betas == PAPER_FORM_BETAS
    assert resolve(ServerConfig(form="paper", betas=(0.5, 0.75)), cls.server_optimizer, method).betas == (0.5, 0.75)
    assert resolve(ServerConfig(betas=(0.5, 0.75)), cls.server_optimizer, method).betas == (0.5, 0.75)
