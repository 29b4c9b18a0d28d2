"""Memory techniques: parameter copy reuse (lesson 07), pipeline-aware activation offload (lesson 08), and
(lesson 00b, import by name) optimizer-state offload to host (``optim_offload``) and disk (``nvme``), activation
spill to a file-backed mapping (``spill``)."""
from .offload import POLICIES, ActivationOffloader, resolve_policy
from .param_reuse import MasterAdamW, ReuseAdamW, count_ties, merge, round_half_away, split

__all__ = ["ActivationOffloader", "POLICIES", "resolve_policy", "ReuseAdamW", "MasterAdamW", "split", "merge",
           "round_half_away", "count_ties"]
