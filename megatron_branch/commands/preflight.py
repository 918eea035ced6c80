"""What every command does before any heavy work: quiet import warnings, one-line usage errors.

Shared by ``megatron-branch`` (:mod:`megatron_branch.cli`) and the tools
(``tools/convert_checkpoint.py``). Output targets are checked with
:func:`megatron_branch.atomic.check_output_file` / ``check_output_dir``; each failure is a
``ValueError``/``OSError`` of one line naming the flag and the path, which
:func:`megatron_branch.distributed.run_main` reports with exit code 2. No torch import.
"""

from __future__ import annotations

import argparse
import warnings


def quiet_megatron_warnings() -> None:
    """Silence megatron-core's import-time warnings about the Apex/Transformer Engine
    fallbacks (expected on CPU), so a failure stays one line. Call before importing it."""
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", module="megatron.core.transformer.transformer_config")


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
