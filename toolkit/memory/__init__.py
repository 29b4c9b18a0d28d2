"""Memory techniques: parameter copy reuse (lesson 07) and pipeline-aware activation offload (lesson 08)."""
from .offload import POLICIES, ActivationOffloader, resolve_policy
from .param_reuse import MasterAdamW, ReuseAdamW, count_ties, merge, round_half_away, split

__all__ = ["ActivationOffloader", "POLICIES", "resolve_policy", "ReuseAdamW", "MasterAdamW", "split", "merge",
           "round_half_away", "count_ties"]
