"""The parser a command gets: one of the CLI's own commands gets only its parser, and parses the same."""

from __future__ import annotations

import argparse

import pytest

from densedev import cli


def commands(parser: argparse.ArgumentParser) -> list[str]:
    """The sub-command names of the ``densedev`` parser."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def test_the_full_parser_has_every_command_and_an_own_command_only_its_own() -> None:
    everything = commands(cli.build_parser())
    assert {"dra-slices", "dra-manifests"} <= set(everything)
    own = [c for c in everything if not c.startswith("dra-")]
    assert set(own) == set(cli._OWN_COMMANDS)
    for command in cli._OWN_COMMANDS:
        assert commands(cli.build_parser(command)) == [command]
    for command in (None, "dra-slices", "dra-manifests", "rn"):
        assert commands(cli.build_parser(command)) == everything


@pytest.mark.parametrize(
    "argv",
    [
        ["run"],
        ["run", "--config", "/c.json", "--no-netlink", "--metrics-addr", ":9477", "--start-timeout", "5"],
        ["check-config", "/c.json", "--strict"],
        ["simulate", "--out", "/tmp/x", "--pfs", "2", "--rdma"],
        ["kubelet-emulator", "/tmp/k", "--allocate", "intel.com/x=2"],
        ["scan", "--json", "--verbose"],
        ["demo", "--seconds", "3", "--dra", "--pfs", "2"],
    ],
)
def test_a_command_parses_the_same_with_only_its_own_parser(argv: list[str]) -> None:
    full = cli.build_parser().parse_args(argv)
    assert cli.build_parser(argv[0]).parse_args(argv) == full


def test_help_and_a_typo_still_name_the_dra_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as help_exit:
        cli.main(["--help"])
    assert help_exit.value.code == 0
    assert "dra-slices" in capsys.readouterr().out
    with pytest.raises(SystemExit) as typo:
        cli.main(["rn"])
    assert typo.value.code == 2
    assert "'dra-manifests'" in capsys.readouterr().err


@pytest.mark.parametrize("columns", ["", "0", "abc", "40", "200"])
def test_the_help_width_is_argparse_own(columns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # cli._Formatter reads the terminal width itself (no shutil at start): the same rule as argparse's.
    monkeypatch.setenv("COLUMNS", columns)
    ours = cli._Formatter("densedev")
    theirs = argparse.HelpFormatter("densedev")
    assert ours._width == theirs._width
