"""Model ids as clients write them: `org/repo@main:Q4` and `org/repo:Q4` name the same model.

`@main` is the default revision, so it is dropped, but only where it is a whole revision: followed by the `:` that
starts the quantisation, or ending the id. `org/repo@mainland:Q4` names another revision and stays as it is.
"""

from __future__ import annotations

import re

_DEFAULT_REVISION = re.compile(r"@main(?=:|$)")


def canonical_model_id(model_id: str) -> str:
    return _DEFAULT_REVISION.sub("", model_id.strip(), count=1)


def same_model(requested: str, served: str) -> bool:
    return canonical_model_id(requested) == canonical_model_id(served)
