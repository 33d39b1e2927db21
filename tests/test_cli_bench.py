"""`gradsync bench`'s shared command-line options."""

from __future__ import annotations

import argparse

from gradsync.cli.bench import add_network_options, network_of


def test_testbed_options_without_testbed_are_named_as_having_no_effect(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_network_options(parser, parser)
    args = parser.parse_args(["--bandwidth", "100mbit", "--no-probe"])
    assert network_of(args, parser) == (False, "100mbit", "0.2ms", False)
    err = capsys.readouterr().err
    assert "--bandwidth has no effect without --testbed" in err
    assert "--no-probe has no effect without --testbed" in err
    assert "--latency" not in err  # left at its default
    with_testbed = parser.parse_args(["--testbed", "--bandwidth", "100mbit"])
    assert network_of(with_testbed, parser) == (True, "100mbit", "0.2ms", True)
    assert capsys.readouterr().err == ""
