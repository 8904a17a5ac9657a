"""What the command line says before its flags are parsed: which word is the command, and the SR-IOV
network device plugin's command line read as ``densedev run``'s.

Both the entry point (``densedev.__main__``, which forks ``run``'s first scan before the command module
loads) and the command module (which builds only that command's parser) read it here, so the two never
disagree on what is run.

Operators swap images in DaemonSets that run the Go plugin's image with its own arguments and no
command word (its entrypoint script takes ``--config-file``, ``--resource-prefix``, ``--use-cdi``,
``--log-level=N`` and ``--log-dir``; the binary behind it also takes glog's flags and Go's one-dash
spellings of all of them).  ``go_plugin_argv`` turns such a list into ``run`` and its flags.  The RDMA
shared device plugin's image runs with no argument at all (``run``'s config search finds its file), and
its binary's flags are ``--config-file``, ``--use-cdi`` and ``-v``/``-version`` (print the version).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: the entry point loads this first
if TYPE_CHECKING:
    from collections.abc import Sequence

# The Go plugin's own flags that ``run`` takes as they are (cli.build_parser declares them).
GO_PLUGIN_FLAGS = frozenset(("--config-file", "--resource-prefix", "--use-cdi", "--log-level", "--log-dir"))
# glog's flags (k8s.io/klog and github.com/golang/glog register them on the Go plugin's command line):
# True where the flag takes a value (``-flag value`` or ``-flag=value``), False for booleans, which
# Go's flag package takes only as ``-flag`` or ``-flag=value``.  None of them changes what densedev
# does: they are dropped with one warning each, never a failed start.
GLOG_FLAGS = {
    "--logtostderr": False,
    "--alsologtostderr": False,
    "--stderrthreshold": True,
    "--log_dir": True,
    "--log_file": True,
    "--log_file_max_size": True,
    "--log_backtrace_at": True,
    "--vmodule": True,
    "--skip_headers": False,
    "--skip_log_headers": False,
    "--add_dir_header": False,
    "--one_output": False,
}
# glog's verbosity is the Go plugin's log level under another name (its entrypoint passes --log-level
# on as -v): it is read as --log-level, not dropped.  The RDMA shared device plugin's -v, a boolean
# (Go's flag package takes no separate value for one), is its --version: a -v with no number is that.
_VERBOSITY = ("-v", "--v")
_VERSION = frozenset(("-version", "--version"))
_TOP_LEVEL = frozenset(("-h", "--help", "--version"))


def command_word(argv: Sequence[str]) -> str | None:
    """Return the command ``argv`` names: its first word that is not an option (the top level's own
    options, ``--help`` and ``--version``, take no value), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def _flag_name(arg: str) -> str:
    """Return the flag an argument names, spelled with two dashes and without its ``=value``."""
    name = arg.partition("=")[0]
    if name in _VERBOSITY:
        return "-v"
    if name.startswith("-") and not name.startswith("--"):
        name = "-" + name  # Go's flag package takes -flag and --flag alike
    return name


def _is_version_v(args: Sequence[str]) -> bool:
    """Whether ``args`` start with the RDMA shared device plugin's ``-v`` (a boolean: print the version):
    a -v followed by no number, or ``-v=true``."""
    name, eq, value = args[0].partition("=")
    if name not in _VERBOSITY:
        return False
    if eq:  # -v=N is a verbosity; -v=true the boolean (Go's flag package: 1 is true too, and a level)
        return value.lower() in ("true", "t")
    return len(args) == 1 or not args[1].isdecimal()


def go_plugin_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Return ``argv`` as densedev's parser reads it, and one note per glog flag it dropped or read.

    A list that starts with one of the Go plugin's flags (or glog's) has no command word: it is
    ``run``'s.  Anywhere in a run's arguments, one-dash spellings of the Go plugin's flags get their
    second dash, ``-v N`` becomes ``--log-level N``, and glog's other flags are dropped (with their
    value, where they take one).  A list that starts with ``-version`` or a ``-v`` without a number
    asks for the version.  Any other list is returned as it is.
    """
    args = list(argv)
    if not args:
        return args, []
    if args[0] in _VERSION or _is_version_v(args):
        return ["--version"], []
    first = _flag_name(args[0])
    known = first in GO_PLUGIN_FLAGS or first in GLOG_FLAGS or first == "-v"
    if known and args[0] not in _TOP_LEVEL:
        args.insert(0, "run")
    elif command_word(args) != "run":
        return args, []
    out: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name = _flag_name(arg) if arg.startswith("-") else ""
        value_inline = "=" in arg
        if name == "-v":
            value = arg.partition("=")[2] if value_inline else (args[i + 1] if i + 1 < len(args) else "")
            out.append(f"--log-level={value}")
            notes.append(f"glog's {arg.partition('=')[0]} {value} is read as --log-level={value}")
            i += 1 if value_inline else 2
            continue
        if name in GLOG_FLAGS:
            takes_value = GLOG_FLAGS[name] and not value_inline
            dropped = arg if not takes_value or i + 1 >= len(args) else f"{arg} {args[i + 1]}"
            notes.append(f"glog flag {dropped} ignored: densedev logs to stderr, as Kubernetes expects")
            i += 2 if takes_value else 1
            continue
        if name in GO_PLUGIN_FLAGS and not arg.startswith("--"):
            arg = "-" + arg
        out.append(arg)
        i += 1
    return out, notes
