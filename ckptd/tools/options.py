"""The CLI's option values, and ``ckptd start``'s options: one table from which the parser, the
``DaemonConfig`` and a detached start's argv all follow.

Each option names the ``DaemonConfig`` field it sets; its default is that
field's default (the parser leaves an option out unless it is given, so the
config applies its own), and the help text quotes it. A detached start
re-runs ``ckptd start`` in a child process: the parent builds (and so
checks) the config, then hands the child the options that were given, as
the config normalised them (roots and files absolute, URLs spelt out).
Adding an option is one row here and one field there.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ckptd.protocol.objects import check_url, display, object_url

from ckptd.core.config import DaemonConfig


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return int(text)


def memory_size(text: str) -> int:
    from ckptd.tools.export import parse_size

    if text.strip().lstrip("-").isdigit():  # a plain number (0, -1): the range check names the bounds
        return int(text)
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, optionally with a suffix (8GiB, 500MB), "
                                         f"got {text!r}") from None


def port(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port between 1 and 65535, got {text!r}")
    return int(text)


def path_arg(text: str) -> Path:
    """A local path or an s3:// URL, checked as the client checks one (``check_url``) before a Path collapses it."""
    try:
        check_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return Path(text)


def keep_arg(text: str) -> tuple[Path, int]:
    directory, sep, count = text.rpartition("=")
    if not sep or not directory or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected DIR=K with K >= 1, got {text!r}")
    return Path(directory), int(count)


def mirror_arg(text: str) -> tuple[Path, Path]:
    local, sep, remote = text.partition("=")
    if not sep or not local or not remote.startswith("s3://"):
        raise argparse.ArgumentTypeError(f"expected DIR=s3://BUCKET/PREFIX, got {text!r}")
    return Path(local), path_arg(remote)


@dataclass(frozen=True)
class StartOption:
    """One ``ckptd start`` option and the ``DaemonConfig`` field it sets."""

    flag: str
    field: str
    help: str
    parse: Callable[[str], Any] | None = None
    """argparse's ``type``; None for a flag without a value (it sets ``flag_value``)."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    repeated: bool = False
    """Given once per item (``--root A --root B``): the field holds them all (a tuple, or a dict of pairs)."""
    flag_value: Any = True
    """What a flag without a value sets its field to."""

    @property
    def dest(self) -> str:
        return self.field

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        default = self.default_text()
        help_text = f"{self.help} (default {default})" if default else self.help
        if self.parse is None and self.choices is None:
            parser.add_argument(self.flag, dest=self.dest, action="store_const", const=self.flag_value,
                                default=argparse.SUPPRESS, help=help_text)
            return
        parser.add_argument(self.flag, dest=self.dest, type=self.parse, metavar=self.metavar, choices=self.choices,
                            action="append" if self.repeated else "store", default=argparse.SUPPRESS, help=help_text)

    def default_text(self) -> str:
        """The field's default as the help quotes it (empty: none worth quoting, or computed at start)."""
        spec = next(f for f in dataclasses.fields(DaemonConfig) if f.name == self.field)
        if spec.default in (dataclasses.MISSING, None, ()) or isinstance(spec.default, bool):
            return ""
        return f"{spec.default:g}" if isinstance(spec.default, float) else str(spec.default)

    def to_config(self, value: Any) -> Any:
        if not self.repeated:
            return value
        return dict(value) if isinstance(value[0], tuple) else tuple(value)

    def to_argv(self, value: Any) -> list[str]:
        """``value`` (as the config holds it) back into command-line words."""
        if self.parse is None and self.choices is None:
            return [self.flag] if value == self.flag_value else []
        if value is None:
            return []
        if isinstance(value, dict):
            return [w for k, v in value.items() for w in (self.flag, f"{k}={_word(v)}")]
        if isinstance(value, tuple):
            return [w for item in value for w in (self.flag, _word(item))]
        return [self.flag, _word(value)]


def _word(value: Any) -> str:
    if isinstance(value, Path):
        return object_url(value) if str(value).startswith("s3:") else display(value.absolute())
    return str(value)  # a float's str round-trips


START_OPTIONS: tuple[StartOption, ...] = (
    StartOption("--root", "roots", "allow checkpoints below DIR (repeatable; default $CKPTD_ROOTS or /)",
                path_arg, "DIR", repeated=True),
    StartOption("--max-concurrent-writes", "max_concurrent_writes", "shard files written at once on this node",
                positive_int, "N"),
    StartOption("--exit-when-idle", "exit_when_idle", "exit after this long with no clients and no work",
                seconds, "SECONDS"),
    StartOption("--buffered-io", "direct_io", "do not use O_DIRECT", flag_value=False),
    StartOption("--keep", "keep_last", "retention: keep only the K newest checkpoints in DIR and below (repeatable)",
                keep_arg, "DIR=K", repeated=True),
    StartOption("--mirror", "mirrors", "upload every checkpoint committed under DIR to the prefix after its commit "
                "(repeatable)", mirror_arg, "DIR=s3://BUCKET/PREFIX", repeated=True),
    StartOption("--mirror-keep", "mirror_keep", "keep only the N newest mirrored checkpoints beside each upload on "
                "the store", positive_int, "N"),
    StartOption("--max-concurrent-loads", "max_concurrent_loads", "default cap on ranks of this node loading at "
                "once (loads that ask for it)", positive_int, "N"),
    StartOption("--metrics-port", "metrics_port", "serve Prometheus metrics on this port (needs prometheus-client)",
                port, "PORT"),
    StartOption("--metrics-addr", "metrics_addr", "address for --metrics-port", str, "ADDR"),
    StartOption("--metrics-textfile", "metrics_textfile", "write Prometheus metrics to FILE every second",
                Path, "FILE"),
    StartOption("--sweep", "sweep", "on start, remove, move aside, or keep orphaned .incomplete directories",
                choices=("remove", "move", "off")),
    StartOption("--drain-timeout", "drain_timeout", "on stop, wait this long for checkpoints still missing ranks",
                float, "SECONDS"),
    StartOption("--storage", "storage", "checkpoint storage implementation (default $CKPTD_STORAGE, else the local "
                "filesystem)", str, "MODULE:CLASS"),
    StartOption("--housekeeping-interval", "housekeeping_interval", "how often to look for dead clients and "
                "overdue checkpoints", seconds, "SECONDS"),
    StartOption("--memory-budget", "memory_budget", "node memory for held snapshots, e.g. 8GiB (default: half of "
                "/dev/shm's free space, at most a quarter of the RAM)", memory_size, "BYTES"),
    StartOption("--keep-snapshots", "keep_snapshots", "newest memory snapshots kept per checkpoint directory",
                positive_int, "K"),
    StartOption("--peer-listen", "peer_listen", "open the peer endpoint for other nodes' daemons (CurveZMQ on "
                "PORT, the replicas' bytes on PORT+1; default $CKPTD_PEER_LISTEN; without either no TCP port "
                "is opened); alone, the job's ranks name the peers and the buddy", str,
                "tcp://HOST:PORT"),
    StartOption("--peer", "peers", "another node's peer endpoint (repeatable): the first is the buddy that holds a "
                "replica of every snapshot (it wins over the ranks' ring)", str, "tcp://HOST:PORT", repeated=True),
    StartOption("--peer-keys", "peer_keys", "the trusted peers' public keys, and the endpoints of those given as "
                "--peer (lines of `ckptd peer-key`); without it the ranks' ring names them", Path, "FILE"),
    StartOption("--replicas", "replicas", "copies of each snapshot on other nodes (default 1 with a --peer or "
                "--peer-listen, else 0)", int, "N"),
    StartOption("--peer-timeout", "peer_timeout", "seconds a peer has to answer each step of a replication, "
                "and a data connection to come or to send its next bytes",
                seconds, "SECONDS"),
    StartOption("--peer-rate", "peer_rate", "bytes a second the replicas' streams to the buddy keep to, e.g. 2GB "
                "(default: as fast as the link); a stream's 4 MiB frame still leaves at link speed", memory_size,
                "BYTES"),
    StartOption("--peer-encrypt", "peer_encrypt", "encrypt the replicas' bytes between daemons (AES-256-GCM); "
                "by default they travel in the clear, each frame authenticated (GMAC) and every shard checksummed, "
                "at less CPU a byte: for a network others can read", flag_value=True),
    StartOption("--peer-send-all", "peer_send_changed", "send the buddy every byte of every snapshot, also the "
                "chunks it holds from this node already (no SHA-256 pass over each snapshot: for a link faster than "
                "hashing, where its share does not matter)", flag_value=False),
    StartOption("--persist-on-exit", "persist_on_exit", "when a trainer closes or dies, write its newest snapshot "
                "to disk", choices=("newest", "never")),
)
ALWAYS_PASSED = frozenset({"roots", "peer_listen"})
"""Fields a detached start always passes on: their default is read from the parent's environment."""


def add_start_options(parser: argparse.ArgumentParser) -> None:
    for option in START_OPTIONS:
        option.add_to(parser)


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``DaemonConfig`` keyword arguments of the options given (the others keep the config's defaults)."""
    given = vars(args)
    return {o.field: o.to_config(given[o.dest]) for o in START_OPTIONS if o.dest in given}


def detached_argv(config: DaemonConfig, args: argparse.Namespace) -> list[str]:
    """The options a detached daemon is started with: those given, as ``config`` normalised them."""
    given = vars(args)
    return [word for o in START_OPTIONS if o.dest in given or o.field in ALWAYS_PASSED
            for word in o.to_argv(getattr(config, o.field))]
