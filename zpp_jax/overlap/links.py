"""Compiling a step with what each collective costs on the links it crosses.

XLA's scheduler gives every asynchronous collective the same latency (its
approximate estimator), whatever its bytes and whichever links it crosses.
`compile_with_links` compiles a step once more with a latency profile that
prices each collective on the links it crosses (`zpp_jax.overlap.LinkModel`),
as `Trainer.compile_step` does.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from zpp_jax.overlap.hlo import collectives_in_hlo, scheduling_names
from zpp_jax.overlap.options import LinkModel


def collective_latencies_us(hlo_text: str, per_node: int, links: LinkModel) -> dict[str, float]:
    """The microseconds `links` gives each asynchronous collective of
    `hlo_text` (a program compiled for a mesh with `per_node` devices a
    node, `zpp_jax.mesh.devices_per_node`: local x model), by the name
    XLA's scheduler knows it by."""
    names = scheduling_names(hlo_text)
    return {
        names.get(c.name, c.name): links.cost_us(c.moved_bytes, c.spans_nodes(per_node))
        for c in collectives_in_hlo(hlo_text)
    }


# The links `collective_links` names: a collective whose group spans nodes
# is bound by the NICs (its NVLink hops are faster), any other by NVLink.
NIC, NVLINK = "nic", "nvlink"


def collective_links(hlo_text: str, per_node: int) -> dict[str, str]:
    """The link (`NIC` or `NVLINK`) each asynchronous collective of
    `hlo_text` crosses, by the names `collective_latencies_us` uses."""
    names = scheduling_names(hlo_text)
    return {
        names.get(c.name, c.name): NIC if c.spans_nodes(per_node) else NVLINK
        for c in collectives_in_hlo(hlo_text)
    }


def collective_costs(hlo_text: str, per_node: int, links: LinkModel) -> str:
    """A latency profile (XLA's ``ProfiledInstructionsProto``, text format)
    pricing each asynchronous collective of `hlo_text` as
    `collective_latencies_us` does; nothing else is priced."""
    latencies = collective_latencies_us(hlo_text, per_node, links)
    lines = [f'costs {{ name: "{name}" cost_us: {us:.3f} }}' for name, us in latencies.items()]
    return "\n".join(lines) + "\n"


# The option that points XLA:GPU's scheduler at a latency profile.
_PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"


def compile_with_links(lowered, options: dict, per_node: int, links: LinkModel | None):
    """`lowered` compiled with `options`; on a GPU, with `links`, twice: once
    to learn the program's collectives, and once scheduled with their costs
    (`collective_costs`). Both compiles see the same program, so the second
    schedules the instructions the first named. Costs a second compile."""
    first = lowered.compile(compiler_options=options or None)
    if links is None or not options.get("xla_gpu_enable_latency_hiding_scheduler"):
        return first
    profile = collective_costs(first.as_text(), per_node, links)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "links.pbtxt")
        with open(path, "w") as f:
            f.write(profile)
        with _without_profile_log():
            return lowered.compile(compiler_options={**options, _PROFILE_OPTION: path})


@contextlib.contextmanager
def _without_profile_log():
    """The process's stderr with the lines of XLA's profile reader left out:
    it names every instruction the profile does not price (all but the
    collectives, thousands per program). Everything else is written on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            kept = [x for x in log.read().splitlines(True) if _PROFILE_LOG not in x]
            if kept:
                os.write(2, b"".join(kept))


_PROFILE_LOG = b"profile_guided_latency_estimator"
