"""The Strata operator: reads a ModelDeployment, plans where the model fits, and reconciles its children.

Imported as `strata.operator`; the folder name never becomes a top-level package, so the standard library's
`operator` module stays importable everywhere.
"""
