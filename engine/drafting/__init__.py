"""Drafting: the Drafter protocol, tree growth, model / n-gram / feature-head drafters, node selection with λ."""
