"""Tensors between Ray processes as raw bytes (raysim.engine.wire): the same bits, dtype and shape
as torch's own pickling gives, writable and independent of the object store; what the byte path
does not take travels as torch pickles it. Read-only tensors (a host's partial sums) arrive as
views of the object store."""
import pytest
import torch

from raysim.core.tensors import ReadOnlyTensors
from raysim.engine import wire

CASES = {
    "float64 partial sum": lambda: torch.randn(300, 200, dtype=torch.float64),  # > 100 KB: the object store
    "float32": lambda: torch.randn(7, 3),
    "zero-dim": lambda: torch.tensor(3.25),
    "empty": lambda: torch.empty(0, 5),
    "bool": lambda: torch.tensor([True, False, True]),
    "int64": lambda: torch.arange(-5, 6),
    "bfloat16": lambda: torch.randn(9).to(torch.bfloat16),
    "float16": lambda: torch.randn(4, 4).half(),
    "complex64": lambda: torch.randn(3, dtype=torch.complex64),
    "a view into a larger storage": lambda: torch.arange(100.0)[10:20],
    "non-contiguous (torch's path)": lambda: torch.randn(4, 6).t(),
    "parameter (torch's path)": lambda: torch.nn.Parameter(torch.randn(5)),
    "requires grad (torch's path)": lambda: torch.randn(5, requires_grad=True),
}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same type, dtype, shape, grad flag and bits (nan included)."""
    if (type(a), a.dtype, a.shape, a.requires_grad) != (type(b), b.dtype, b.shape, b.requires_grad):
        return False
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_the_byte_path_takes_plain_cpu_tensors_only():
    assert wire.tensor_to_wire(torch.zeros(3, dtype=torch.float64))[0] == "bytes"
    assert wire.tensor_to_wire(torch.arange(10.0)[2:5])[0] == "bytes"  # contiguous view: its own elements
    for other in (torch.zeros(3, 4).t(), torch.nn.Parameter(torch.zeros(2)), torch.zeros(2, requires_grad=True)):
        assert wire.tensor_to_wire(other)[0] == "torch"


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_round_trip_gives_the_same_tensor(name):
    t = CASES[name]()
    back = wire.tensor_from_wire(wire.tensor_to_wire(t))
    assert same(back, t)
    assert back.is_contiguous() or not t.is_contiguous()


@pytest.fixture(scope="module")
def sender(ray_session):
    """An actor that installed the byte path, as the server and the hosts do in start()."""
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Sender:
        def __init__(self):
            wire.install()

        def send(self, name):
            torch.manual_seed(0)
            return {"tensor": CASES[name](), "nested": [CASES[name]()]}

    return Sender.remote()


def test_tensors_from_an_actor_arrive_bit_for_bit_as_torch_pickles_them(ray_session, sender):
    ray = ray_session
    for name, make in CASES.items():
        got = ray.get(sender.send.remote(name))
        torch.manual_seed(0)
        expected = make()
        assert same(got["tensor"], expected), name
        assert same(got["nested"][0], CASES[name]()), name  # the second draw of the same stream


def test_a_received_tensor_is_writable_and_its_own(ray_session, sender):
    ray = ray_session
    ref = sender.send.remote("float64 partial sum")
    first, second = ray.get(ref)["tensor"], ray.get(ref)["tensor"]
    first.zero_()  # the object store's copy is read-only: this writes a private copy
    assert float(first.abs().sum()) == 0.0
    torch.manual_seed(0)
    assert torch.equal(second, CASES["float64 partial sum"]())


def test_read_only_tensors_round_trip_as_read_only_tensors():
    sent = {name: CASES[name]() for name in sorted(CASES)}
    back = wire.read_only_from_wire(wire.read_only_to_wire(ReadOnlyTensors(sent)))
    assert type(back) is ReadOnlyTensors
    assert sorted(back) == sorted(sent)
    for name in sent:
        assert same(back[name], sent[name]), name


def test_a_hosts_partial_sums_arrive_as_views_of_the_object_store(ray_session):
    """The server only reads a host's sums (raysim.core.aggregation.reduce_sums never writes them):
    they arrive without a private copy, the same bits; plain tensors beside them still copy."""
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Host:
        def __init__(self):
            wire.install()

        def partial(self):
            torch.manual_seed(0)
            sums = ReadOnlyTensors({"w": torch.randn(300, 200, dtype=torch.float64), "b": torch.randn(5)})
            return sums, {"w": sums["w"].clone()}

    ref = Host.remote().partial.remote()
    (first, plain1), (second, plain2) = ray.get(ref), ray.get(ref)
    assert type(first) is ReadOnlyTensors
    assert first["w"].data_ptr() == second["w"].data_ptr()  # both views of the one stored object
    assert plain1["w"].data_ptr() != plain2["w"].data_ptr()  # a plain tensor: a private copy each
    torch.manual_seed(0)
    assert same(first["w"], torch.randn(300, 200, dtype=torch.float64)) and same(first["b"], torch.randn(5))
