"""The model zoo.

    from raysim.models import build, available, count_params, count_flops, NormSpec
    model = build("cnn6", num_classes=10, in_channels=3, input_size=28, norm="bn")
    z = model.features(x)          # (B, model.feature_dim)
    logits = model.head(z)         # == model(x)

Every model: ``features`` (x -> flat z), ``head`` (nn.Linear), ``feature_dim``,
``input_shape`` (the published (C, H, W)). Every norm layer comes from ``make_norm`` and
sits in a slot whose name contains "bn"; every conv comes from the ``conv`` factory.

==============  ==========================================  ==============  ===========
name            source                                      input           norm default
==============  ==========================================  ==============  ===========
cnn6            FedBN / FedWon Table 5                      3x28x28 (32)    bn
alexnet         FedWon Table 6 (FedBN's AlexNet, Dropout)   3x256x256       bn
alexnet_fdse    FDSE Table A5 (1024-wide FC + BN1d)         3x256x256       bn
resnet10        DapperFL, CIFAR-style                       3x32x32         bn
resnet18        DapperFL, CIFAR-style                       3x32x32         bn
resnet18_tv     torchvision (gPerXAN, CSAC, FedWon Tab 13)  3x224x224       bn
resnet50_tv     torchvision (gPerXAN, FDSE Table A8)        3x224x224       bn
densenet121_tv  torchvision layout (gPerXAN Camelyon17)     3x224x224 (96)  bn
mnist_cnn       CSAC Rotated MNIST (2 conv + 2 FC)          1x28x28         none
small_cnn       cross-device CNN, ~0.1M parameters          3x32x32 (28)    bn
mlp             two-layer MLP (hidden 0: logistic reg.)     1x28x28         none
==============  ==========================================  ==============  ===========
"""
from raysim.models.base import ConvFactory, Net, default_conv, resolve_conv
from raysim.models.norm import NORM_NAMES, NormFactory, NormSpec, gn_groups, is_norm, make_norm
from raysim.models.registry import available, build, options, register
from raysim.models.flops import count_flops, count_params
from raysim.models.pretrained import load_pretrained

# Importing the model modules fills the registry.
from raysim.models import alexnet as _alexnet  # noqa: E402,F401
from raysim.models import cnn as _cnn  # noqa: E402,F401
from raysim.models import densenet_tv as _densenet_tv  # noqa: E402,F401
from raysim.models import mlp as _mlp  # noqa: E402,F401
from raysim.models import resnet_cifar as _resnet_cifar  # noqa: E402,F401
from raysim.models import resnet_tv as _resnet_tv  # noqa: E402,F401



def from_setup(setup, **overrides):
    """The model a federation's ``Setup`` describes (``setup.model``: name, norm, pretrained,
    options; its classes and input shape), with keyword ``overrides`` (e.g. ``norm="none"``)."""
    m = setup.model
    kw = dict(num_classes=setup.num_classes, in_channels=setup.image_shape[0], input_size=setup.image_shape[-1],
              norm=m.norm, pretrained=m.pretrained, **m.options)
    kw.update(overrides)
    return build(m.name, **kw)


__all__ = [
    "from_setup", "build", "available", "options", "register", "count_params", "count_flops", "load_pretrained",
    "NormSpec", "NormFactory", "NORM_NAMES", "make_norm", "gn_groups", "is_norm",
    "Net", "ConvFactory", "default_conv", "resolve_conv",
]
