"""raysim.core.errors.first_line: the one "first line of an error" every message uses."""
from raysim.core.errors import UserError, first_line


def test_the_first_non_blank_line_stripped_or_the_type_name():
    assert first_line(ValueError("bad value\n  at line 3")) == "bad value"
    assert first_line(UserError("\n  data.root: not found  \nmore")) == "data.root: not found"
    assert first_line(KeyError()) == "KeyError"  # a blank message: the type says what it was
    assert first_line(OSError(""), default="") == ""


def test_cut_to_a_limit_and_with_the_type():
    err = RuntimeError("x" * 400 + "\nsecond")
    assert first_line(err, limit=200) == "x" * 200
    assert first_line(err, with_type=True, limit=300) == ("RuntimeError: " + "x" * 400)[:300]
    assert first_line(RuntimeError(), with_type=True) == "RuntimeError: "
