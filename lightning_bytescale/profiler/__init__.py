"""The cost-model profiler: measure a model's layers and links on this device, fit the planner's cost model.

:func:`run_profile` measures ``T(s)`` and ``Act(s)`` of one transformer layer at several
lengths, the host link and (optionally) the point-to-point link, fits the planner's
:class:`~lightning_bytescale.planner.cost_model.CostModel` and derives the token capacity
``C`` (of one device, or with ``tensor_parallel=N`` of one HDP rank that is a tensor-parallel
group of ``N``); :func:`profile_model` returns only the fitted cost model.  The :class:`Profile` it
returns is saved as the cost-model file that the planner, the strategy and the simulator load;
``bytescale-profile`` (:mod:`lightning_bytescale.cli.profile`) is the command line over this
package.
"""

from lightning_bytescale.profiler.errors import ProfileError
from lightning_bytescale.profiler.links import P2PBandwidth, measure_bandwidth, measure_p2p_bandwidth
from lightning_bytescale.profiler.record import Profile, load_profile
from lightning_bytescale.profiler.run import profile_model, run_profile

__all__ = [
    "P2PBandwidth",
    "Profile",
    "ProfileError",
    "load_profile",
    "measure_bandwidth",
    "measure_p2p_bandwidth",
    "profile_model",
    "run_profile",
]
