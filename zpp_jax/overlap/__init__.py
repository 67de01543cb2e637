"""What runs behind what: everything that orders the engine's communication
against its compute, and nothing of the math.

* `options`: the XLA options per platform (`overlap_options`), whether units
  prefetch their gathers, and the `LinkModel` of a cluster's links.
* `relay`: the relay token that orders consecutive units' collectives
  against each other's compute, its ties, and the chain of the current
  trace (`relay_scope`).
* `loops`: layer loops unrolled so that their units join one relay chain.
* `hlo`: the collectives of a compiled program's HLO text, their bytes and
  the links they cross; `links`: a step compiled with each collective
  priced on its links (`compile_with_links`), so that XLA's scheduler
  orders them by what they cost. `zpp_jax.analysis` reads programs with
  the same reader.

The engine core (`zpp_jax.layer`, `zpp_jax.unit`) calls it through hooks;
nothing here changes a value.
"""

from zpp_jax.overlap.options import (
    DEFAULT_LINKS,
    LinkModel,
    check_links,
    overlap_options,
    platform,
    prefetches,
    schedules_overlap,
)
from zpp_jax.overlap.relay import relay_scope

__all__ = [
    "DEFAULT_LINKS",
    "LinkModel",
    "check_links",
    "platform",
    "prefetches",
    "relay_scope",
    "schedules_overlap",
    "overlap_options",
]
