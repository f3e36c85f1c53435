"""The `graphidx` command (console script `graphidx`, or `python -m graphidx`).

Subcommands: `demo` (cli/demo.py), `replay-check` (cli/replay_check.py), `capture`
(cli/capture.py), `bench` (cli/bench.py over graphidx.bench). The library never imports this
package.
"""

from graphidx.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
