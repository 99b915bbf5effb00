"""Model ids: `@main` is the default revision and is dropped, but only as a whole revision."""

from __future__ import annotations

import pytest
from strata.gateway.model_ids import canonical_model_id, same_model


@pytest.mark.parametrize(
    ("requested", "served", "same"),
    [
        pytest.param("org/repo@main:Q4", "org/repo:Q4", True, id="@main before the quantisation is dropped"),
        pytest.param("org/repo:Q4", "org/repo@main:Q4", True, id="the served id may carry @main instead"),
        pytest.param("org/repo@main", "org/repo", True, id="@main ending the id is dropped"),
        pytest.param("org/repo@mainland:Q4", "org/repo:Q4", False, id="@mainland is another revision"),
        pytest.param("org/repo@mainland", "org/repo", False, id="@mainland ending the id is another revision"),
        pytest.param("org/repo@dev:Q4", "org/repo:Q4", False, id="another revision is another model"),
        pytest.param("org/repo:Q8", "org/repo:Q4", False, id="another quantisation is another model"),
        pytest.param("org/repo@main:Q4", "org/repo@main:Q4", True, id="identical ids match"),
    ],
)
def test_model_ids_match_as_documented(requested: str, served: str, same: bool) -> None:
    assert same_model(requested, served) is same


def test_the_canonical_id_keeps_everything_but_a_default_revision() -> None:
    assert canonical_model_id("org/repo@main:Q4_K_M") == "org/repo:Q4_K_M"
    assert canonical_model_id("org/repo@mainline") == "org/repo@mainline"
