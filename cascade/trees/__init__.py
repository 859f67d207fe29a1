"""Token-tree drafting: ``TreeDrafter`` (``drafter``) grows a tree with a policy (a strategy)
and verifies it in one forward. One module per policy: ``static``, ``reranked`` (EAGLE-2),
``dynamic`` (DyTC, with its own pricing); ``growth`` holds the tree being grown and the
drafters' calls, ``acceptance`` the node acceptance estimates, ``guard`` DyTC's guarantee."""

from cascade.trees.drafter import TreeDrafter
from cascade.trees.dynamic import DynamicTreePolicy
from cascade.trees.policy import TreePolicy
from cascade.trees.reranked import RerankedTreePolicy
from cascade.trees.static import StaticTreePolicy

__all__ = ["DynamicTreePolicy", "RerankedTreePolicy", "StaticTreePolicy", "TreeDrafter", "TreePolicy"]
