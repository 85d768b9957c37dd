"""``raysim methods`` (the method catalog) and ``raysim compare`` (one table across run directories),
on small run directories written in the metrics.parquet schema that ``raysim run`` writes."""
import os
import re
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from raysim.cli import main
from raysim.engine.metrics import MetricsLog


def flat(text: str) -> str:
    """A Markdown table as the tests read it: one space of padding, plain separators."""
    text = re.sub(r" {2,}", " ", text)
    return re.sub(r"\|:?-+:?(?=\|)", "|---", text)


def raysim(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "raysim", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def one_line_error(r):
    assert r.returncode == 2, (flat(r.stdout), r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("raysim: error: "), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


# ----------------------------------------------------------------------------- methods

def test_methods_lists_every_method(capsys):
    from raysim.methods import registry
    assert main(["methods"]) == 0
    out = flat(capsys.readouterr().out)
    for name in registry.names():
        assert f"| {name} |" in out
    assert "| fdse | Wang et al., CVPR 2025 |" in out
    fedfa = next(line for line in out.splitlines() if line.startswith("| fedfa |"))
    assert "| yes |" in fedfa  # FedFA exchanges feature statistics
    assert "fdse/digits5" in next(line for line in out.splitlines() if line.startswith("| fdse |"))


def test_methods_fdse_shows_hyperparameters_and_search_space(capsys):
    assert main(["methods", "fdse"]) == 0
    out = flat(capsys.readouterr().out)
    lines = out.splitlines()
    lam = next(line for line in lines if line.startswith("| lam |"))
    tau = next(line for line in lines if line.startswith("| tau |"))
    assert "0.1" in lam and ">= 0" in lam and "log(0.01, 1)" in lam
    assert "0.5" in tau and "> 0" in tau and "log(0.001, 0.5)" in tau
    assert "one of: 'attention', 'local', 'mean'" in out  # dse_agg's allowed values
    assert "Wang et al., CVPR 2025" in out and "Domain Shift Eraser" in out
    assert "configs/fdse/digits5.yaml" in out


def test_methods_notes_come_from_the_settings_doc_whole():
    """The note column is ``setting(..., doc=...)``, declared with the field (not a source
    comment): a long one is shown whole, and a class defined anywhere (no source) has its notes."""
    from dataclasses import dataclass

    from raysim.app.catalog import hparam_rows
    from raysim.core.hparams import Hparams
    from raysim.core.settings import setting
    from raysim.methods import registry

    bn_stats = next(row for row in hparam_rows(registry.get("dapperfl")) if row[0] == "bn_stats")
    assert bn_stats[-1].startswith("BN running statistics of the upload") and bn_stats[-1].endswith("evaluates at chance)")

    @dataclass(frozen=True)
    class H(Hparams):
        a: float = setting(0.5, ge=0, source="paper", doc="the weight  # of the term")  # not this comment
        b: int = setting(1)

    M = type("M", (), {"Hparams": H})
    assert [(row[0], row[-1]) for row in hparam_rows(M)] == [("a", "the weight  # of the term"), ("b", "")]


def test_methods_renders_choice_and_uniform_spaces():
    from raysim.app.catalog import space_text
    from raysim.core.hparams import Space
    assert space_text(Space.uniform(0.1, 0.9)) == "uniform(0.1, 0.9)"
    assert space_text(Space.log(1e-3, 0.1)) == "log(0.001, 0.1)"
    assert space_text(Space.choice(0.2, 0.4)) == "choice(0.2, 0.4)"
    assert space_text(Space.integer(1, 5)) == "int(1, 5)"


def test_methods_unknown_name_is_one_line_exit_2(tmp_path):
    line = one_line_error(raysim("methods", "nope", cwd=tmp_path))
    assert "unknown method 'nope'" in line and "fdse" in line and "fedavg" in line


# ----------------------------------------------------------------------------- run directories

def write_federation(d, method, test, val, select="val", holdout=False, **config):
    """metrics.parquet + config.yaml of one federation: ``test[r]``/``val[r]`` = {domain: accuracy}
    for rounds 1, 2, ...; AVG (mean over domains) and ALL (here the same) added; ``config``: more
    keys of its config.yaml."""
    os.makedirs(d, exist_ok=True)
    log = MetricsLog()
    for split, per_round in (("test", test), ("val", val)):
        for rnd, accs in enumerate(per_round, start=1):
            for dom, v in accs.items():
                log.add(rnd, -1, dom, split, "accuracy", v)
            mean = sum(accs.values()) / len(accs)
            log.add(rnd, -1, "AVG", split, "accuracy", mean)
            log.add(rnd, -1, "ALL", split, "accuracy", mean)
            log.add(rnd, 0, next(iter(accs)), split, "accuracy", mean)  # a client row: ignored
    log.write(os.path.join(d, "metrics.parquet"))
    cfg = {"method": method, "eval": {"select": select, "protocol": "lodo" if holdout else "personalized"}, **config}
    with open(os.path.join(d, "config.yaml"), "w") as fh:
        yaml.safe_dump(cfg, fh)


def seeded_run(root, methods, paper=None):
    """A comparison directory: <method>/seed-<s>/ for seeds 0 and 1; the best validation round is 2,
    the best test round 3 (so a table that peeks at the test split would differ)."""
    for i, m in enumerate(methods):
        for seed in (0, 1):
            base = 0.5 + 0.1 * i + 0.02 * seed
            test = [{"a": base, "b": base}, {"a": base + 0.1, "b": base + 0.2}, {"a": base + 0.3, "b": base + 0.3}]
            val = [{"a": 0.1, "b": 0.1}, {"a": 0.9, "b": 0.9}, {"a": 0.2, "b": 0.2}]
            write_federation(os.path.join(root, m, f"seed-{seed}"), m, test, val)
    cfg = {"methods": list(methods), "seeds": [0, 1]}
    if paper:
        cfg["paper"] = paper
    with open(os.path.join(root, "config.yaml"), "w") as fh:
        yaml.safe_dump(cfg, fh)
    return str(root)


def row(text, label):
    return next(line for line in text.splitlines() if line.startswith(f"| {label} |"))


def test_compare_two_runs_one_table(tmp_path, capsys):
    paper = {"source": "Somebody et al., Table 1", "dataset": "toy", "metrics": {"AVG": {"fdse": [60.0, 1.5]}}}
    a = seeded_run(tmp_path / "exp_a", ["fedavg", "fdse"], paper=paper)
    b = str(tmp_path / "exp_b")  # a single federation of fdse
    write_federation(b, "fdse", [{"a": 0.7, "b": 0.8}, {"a": 0.75, "b": 0.85}], [{"a": 0.5, "b": 0.5}, {"a": 0.4, "b": 0.4}])
    out = tmp_path / "cmp"
    assert main(["compare", a, b, "--out", str(out)]) == 0
    text = flat(capsys.readouterr().out)
    assert text.count("| method |") == 1  # one table
    header = next(line for line in text.splitlines() if line.startswith("| method |"))
    assert all(c in header for c in ("| a |", "| b |", "| AVG |", "| ALL |", "paper AVG", "Δ AVG"))
    # fedavg at the selected (best validation) round 2: seed 0 a=0.6 b=0.7, seed 1 a=0.62 b=0.72
    fedavg = row(text, "fedavg")
    assert "61.00 ± 1.41" in fedavg and "71.00 ± 1.41" in fedavg and "66.00 ± 1.41" in fedavg
    # fdse in both runs: labelled by run; the paper's AVG beside the first with the difference
    fa, fb = row(text, "fdse (exp_a)"), row(text, "fdse (exp_b)")
    assert "76.00 ± 1.41" in fa and "60.00 ± 1.50" in fa and "+16.00" in fa  # AVG (0.76 + ...)/2
    assert "| 70.00 | 80.00 | 75.00 |" in fb  # single seed, round 1 (best validation)
    assert "val: 2, 2" in fa and "val: 1" in fb
    assert "Somebody et al., Table 1" in text
    # files
    assert flat((out / "compare.md").read_text()).startswith("# Comparison")
    csv = pd.read_csv(out / "compare.csv")
    assert list(csv["row"]) == ["fedavg", "fdse (exp_a)", "fdse (exp_b)"]
    assert csv.loc[1, "paper AVG"] == 60.0 and abs(csv.loc[1, "Δ AVG"] - 16.0) < 1e-9
    assert (out / "compare.png").stat().st_size > 0


def test_compare_by_seed_and_cli(tmp_path):
    a = seeded_run(tmp_path / "exp_a", ["fedavg", "fedbn"])
    r = raysim("compare", a, "--by", "seed", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for label in ("fedavg seed 0", "fedavg seed 1", "fedbn seed 0", "fedbn seed 1"):
        assert f"| {label} |" in flat(r.stdout)
    assert " ± " not in flat(r.stdout).split("| method |")[1]
    assert not (tmp_path / "compare.md").exists()  # files only with --out


def test_compare_lodo_by_holdout(tmp_path, capsys):
    root = tmp_path / "lodo"
    for m in ("fedavg", "fedsr"):
        for dom in ("a", "b"):
            acc = {"fedavg": 0.5, "fedsr": 0.6}[m] + (0.1 if dom == "b" else 0.0)
            write_federation(root / m / f"holdout-{dom}", m, [{dom: acc}], [{dom: acc}], select="final",
                             holdout=True)
    with open(root / "config.yaml", "w") as fh:
        yaml.safe_dump({"methods": ["fedavg", "fedsr"], "paper": {"metrics": {"AVG": {"fedsr": [70.0, None]}}}}, fh)
    assert main(["compare", str(root), "--by", "holdout"]) == 0
    text = flat(capsys.readouterr().out)
    header = next(line for line in text.splitlines() if line.startswith("| method |"))
    assert "| a | b | Avg |" in header and "paper Avg" in header
    assert "| 50.00 | 60.00 | 55.00 |" in row(text, "fedavg")
    assert "| 60.00 | 70.00 | 65.00 | 70.00 | -5.00 |" in row(text, "fedsr")


@pytest.mark.slow
def test_compare_errors_are_one_line(tmp_path):
    assert "no such folder" in one_line_error(raysim("compare", str(tmp_path / "missing"), cwd=tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no metrics.parquet" in one_line_error(raysim("compare", str(empty), cwd=tmp_path))
    a = seeded_run(tmp_path / "exp_a", ["fedavg"])
    assert "--by holdout" in one_line_error(raysim("compare", a, "--by", "holdout", cwd=tmp_path))


def test_summary_puts_the_papers_figures_beside_ours(tmp_path):
    from raysim.app.report import render
    paper = {"source": "Somebody et al., Table 1", "metrics": {"AVG": {"fdse": [60.0, 1.5]}}}
    a = seeded_run(tmp_path / "exp_a", ["fedavg", "fdse"], paper=paper)
    text = flat(render(a))
    section = text.split("## Beside the published numbers")[1]
    assert "60.00 ± 1.50" in row(section, "fdse") and "+16.00" in row(section, "fdse")
    assert "Somebody et al., Table 1" in section
    plain = seeded_run(tmp_path / "exp_b", ["fedavg"])
    assert "Beside the published" not in render(plain)


# ----------------------------------------------------------------------------- what ran

def test_compare_says_when_runs_differ_in_dataset_or_rounds(tmp_path, capsys):
    accs = ([{"a": 0.5, "b": 0.6}, {"a": 0.6, "b": 0.7}], [{"a": 0.4, "b": 0.4}, {"a": 0.5, "b": 0.5}])
    write_federation(tmp_path / "digits", "fedavg", *accs, data={"dataset": "digits5"}, rounds=2)
    write_federation(tmp_path / "office", "fedbn", *accs, data={"dataset": "office_caltech10"}, rounds=2)
    write_federation(tmp_path / "longer", "fedprox", *accs, data={"dataset": "digits5"}, rounds=40)
    assert main(["compare", str(tmp_path / "digits"), str(tmp_path / "office")]) == 0
    text = flat(capsys.readouterr().out)
    line = next(ln for ln in text.splitlines() if ln.startswith("**Not like for like:**"))
    assert "dataset (digits5: fedavg; office_caltech10: fedbn)" in line and "rounds" not in line
    assert text.index(line) < text.index("| method |")  # above the table
    assert main(["compare", str(tmp_path / "digits"), str(tmp_path / "longer")]) == 0
    text = flat(capsys.readouterr().out)
    assert "differ in rounds (2: fedavg; 40: fedprox)" in text and "dataset" not in text
    assert main(["compare", str(tmp_path / "digits"), str(tmp_path / "digits")]) == 0
    assert "Not like for like" not in capsys.readouterr().out  # like for like: no line


def test_a_variant_is_a_row_of_its_own_paired_with_the_first_entry(tmp_path):
    """A comparison whose first entry is a variant: rows in the config's order (not the folders'),
    the pairing against it, what each ran; a method whose server step the config changed says so."""
    from raysim.app import rundir
    from raysim.app.report import render
    root = tmp_path / "cmp"
    entries = {"zz-adam": {"method": "fedavg", "variant": "zz-adam", "server": {"optimizer": "adam"}},
               "fedavg": {"method": "fedavg", "server": {"optimizer": "momentum"}},
               "fedprox": {"method": "fedprox", "hp": {"fedprox": {"mu": 0.5}}}}
    for i, (name, config) in enumerate(entries.items()):
        method = config.pop("method")
        for seed in (0, 1):
            base = 0.5 + 0.1 * i + 0.02 * seed
            test = [{"a": base, "b": base}, {"a": base + 0.1, "b": base + 0.2}]
            val = [{"a": 0.1, "b": 0.1}, {"a": 0.9, "b": 0.9}]
            write_federation(root / name / f"seed-{seed}", method, test, val, seed=seed,
                             rounds=2, **config)
    with open(root / "config.yaml", "w") as fh:
        yaml.safe_dump({"method": None, "seeds": [0, 1], "methods": [
            {"name": "zz-adam", "method": "fedavg", "server": {"optimizer": "adam"}}, "fedavg", "fedprox"]}, fh)
    assert list(rundir.method_dirs(str(root))) == ["zz-adam", "fedavg", "fedprox"]
    assert rundir.method_of(str(root / "zz-adam" / "seed-0")) == "fedavg"
    text = flat(render(str(root)))
    assert "## Paired comparison with zz-adam" in text
    assert row(text, "fedavg + server momentum") and row(text.split("## Paired")[1], "fedprox")
    what = text.split("## What ran")[1].split("Test accuracy")[0]
    assert "**zz-adam**: method fedavg (variant zz-adam)" in what
    assert "server: adam (lr 0.01, betas [0.9, 0.999], tau 0.001, form code); the method's own: sgd (lr 1)" in what
    assert "**fedavg + server momentum**: method fedavg" in what and "server: momentum (lr 1, momentum 0.9)" in what
    assert "hyperparameters: mu=0.5 (default 0.01)" in what
    assert "- rounds: 2; seeds 0, 1" in what
    # the selected round is the final one everywhere: one table for both, the best test round too
    assert "## Selected round: best validation AVG; here also the final round and the best test round" in text
    assert "## Final round" not in text and "## Best test round" not in text
    cmp = flat(main_out(["compare", str(root)]))
    assert "| zz-adam |" in cmp and "| fedavg + server momentum |" in cmp and "Not like for like" not in cmp


def main_out(argv) -> str:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def test_settings_a_server_step_does_not_read_do_not_make_a_changed_row():
    """A FedAvg run written when the default betas were (0.9, 0.99) is still plain ``fedavg``: sgd
    reads no betas; FedAdam's row names betas it runs with other than its own."""
    from raysim.app.tables import _server_line
    from raysim.config import ServerConfig
    from raysim.methods import registry
    assert _server_line(registry.get("fedavg"), ServerConfig(betas=(0.9, 0.99)), "fedavg")[1] == ""
    assert _server_line(registry.get("fedadam"), ServerConfig(betas=(0.9, 0.99)), "fedadam")[1] == "adam betas [0.9, 0.99]"
    line, changed = _server_line(registry.get("fedadagrad"), ServerConfig(betas=(0.9, 0.99)), "fedadagrad")
    assert (line, changed) == ("adagrad (lr 0.1, tau 0.001, form code) (the method's own)", "")  # Keras Adagrad: no β


def test_a_federation_that_stopped_before_its_last_round_is_named_in_compare_and_report(tmp_path):
    """Shown at the rounds it has, and said so: one seed of two stopped after round 1 of 3."""
    from raysim.app.report import render
    root = tmp_path / "run"
    for seed, rounds_done in ((0, 3), (1, 1)):
        test = [{"a": 0.5, "b": 0.5}, {"a": 0.6, "b": 0.6}, {"a": 0.7, "b": 0.7}][:rounds_done]
        val = [{"a": 0.1, "b": 0.1}, {"a": 0.2, "b": 0.2}, {"a": 0.3, "b": 0.3}][:rounds_done]
        write_federation(root / "fedavg" / f"seed-{seed}", "fedavg", test, val, rounds=3)
    (root / "fedavg" / "seed-0" / "status.json").write_text('{"finished": true}')
    with open(root / "config.yaml", "w") as fh:
        yaml.safe_dump({"methods": ["fedavg"], "seeds": [0, 1], "rounds": 3}, fh)
    line = "**Unfinished** (still running, or stopped before their last round; each is shown at the rounds it has): "
    assert line + "fedavg/seed-1 (round 1 of 3)." in flat(main_out(["compare", str(root)]))
    assert "## Unfinished" in render(str(root)) and "fedavg/seed-1 (round 1 of 3)" in render(str(root))
    (root / "fedavg" / "seed-1" / "status.json").write_text('{"finished": true}')  # its status says it finished
    assert "Unfinished" not in main_out(["compare", str(root)])
