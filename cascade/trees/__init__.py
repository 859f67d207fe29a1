"""Token-tree policies (strategies) and what they grow trees with; ``cascade.tree_drafter``
runs them. One module per policy: ``static``, ``reranked`` (EAGLE-2), ``dynamic`` (DyTC, with
its own pricing)."""

from cascade.trees.dynamic import DynamicTreePolicy
from cascade.trees.policy import TreePolicy
from cascade.trees.reranked import RerankedTreePolicy
from cascade.trees.static import StaticTreePolicy

__all__ = ["DynamicTreePolicy", "RerankedTreePolicy", "StaticTreePolicy", "TreePolicy"]
