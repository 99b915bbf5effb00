"""Speculative decoding in the ModelDeployment spec (strata.operator.spec's speculative)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import ConfigDict, Field, model_validator
from strata.operator.spec_fields import (
    ModelSource,
    SpecPart,
    WholeNumber,
    cel,
)


class SpeculativeMethod(StrEnum):
    NGRAM = "ngram"
    DRAFT = "draft"


class Speculative(SpecPart):
    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.minDraft <= self.maxDraft", "minDraft must not exceed maxDraft"),
                cel(
                    "self.method == 'draft' ? has(self.draftModel) : !has(self.draftModel)",
                    "draftModel is required with method draft and applies to it only",
                    ".draftModel",
                ),
                cel("!has(self.pMin) || self.method == 'draft'", "pMin applies to method draft only", ".pMin"),
                cel(
                    "!has(self.draftModel) || !has(self.draftModel.tokenSecretRef) "
                    "|| self.draftModel.url.startsWith('https://') || self.draftModel.url.startsWith('hf://')",
                    "draftModel.tokenSecretRef applies to https:// and hf:// sources only, as model.tokenSecretRef",
                    ".draftModel.tokenSecretRef",
                ),
            ]
        },
    )

    method: SpeculativeMethod = Field(
        description=(
            "ngram: the gateway proposes the tokens that followed the latest earlier occurrence of a request's last "
            "tokens in its own prompt and output (code edits, quoted tool results, structured output repeat "
            "themselves); the stages verify them in one step. draft: a small GGUF of the target's vocabulary "
            "(draftModel), run in each gateway pod on its CPU, proposes its greedy continuation. Applies to requests "
            "without penalties (under a grammar too); the text is the same as without it, sampled text included."
        )
    )
    draft_model: ModelSource | None = Field(
        default=None,
        alias="draftModel",
        description=(
            "The draft GGUF of method draft, given as spec.model is; its vocabulary must be the model's (the gateway "
            "refuses another at start-up, naming both files). The operator reads its header: the gateway pod's "
            "default memory request grows by the draft's weights (float32 on the CPU, quantised blocks kept) and its "
            "KV at the plan's context and lanes; a memory request set in gateway.resources is taken as given."
        ),
    )
    p_min: float | None = Field(
        default=None,
        alias="pMin",
        ge=0.0,
        le=1.0,
        description=(
            "Method draft: a proposal stops before the draft's first pick less likely than this (default 0.3: such a "
            "pick is more often wrong than right, and every draft token after a wrong one is wasted)."
        ),
    )
    max_draft: WholeNumber = Field(
        default=4, alias="maxDraft", ge=1, le=16, description="Tokens proposed a step, at most."
    )
    min_draft: WholeNumber = Field(
        default=1, alias="minDraft", ge=1, le=16, description="Shorter proposals are not sent."
    )
    position_cost: float | None = Field(
        default=None,
        alias="positionCost",
        ge=0.0,
        le=1.0,
        description=(
            "What one more position adds to a decode step's time, in one-position steps (default 0.1). Each step's "
            "drafts are as long as pays by it and the lanes' recent acceptance, and none while the batch is too full "
            "for drafts to pay; bench/speculative.py measures it on the GPUs that serve."
        ),
    )

    @model_validator(mode="after")
    def _draft_bounds(self) -> Speculative:
        """The CEL rule again, for manifests that reach the handlers without the API server's check."""
        if self.min_draft > self.max_draft:
            raise ValueError("speculative needs minDraft <= maxDraft")
        drafting = self.method is SpeculativeMethod.DRAFT
        if drafting != (self.draft_model is not None):
            raise ValueError("speculative draftModel is required with method draft and applies to it only")
        if self.p_min is not None and not drafting:
            raise ValueError("speculative pMin applies to method draft only")
        return self
