"""``raysim data show digits5`` says that its domains are generated stand-ins under the Digits-Five
names (a reader of the table would otherwise take them for the published datasets)."""
from raysim.data.show import table


def test_the_digits5_table_says_its_domains_are_stand_ins(digits5):
    text = table(digits5)
    head = text.split("\n\n")[0]
    assert "generated stand-ins under the Digits-Five names" in head and "not USPS" in head
    assert "digits5_real" in head  # where the real ones are
    assert max(len(line) for line in head.splitlines()) <= 80
    for domain in ("mnist", "mnistm", "usps", "synth", "svhn"):
        assert any(line.startswith(domain) for line in text.splitlines())  # the table itself is unchanged
