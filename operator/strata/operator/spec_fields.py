"""The building blocks of the ModelDeployment spec (strata.operator.spec): the base model every part derives from, the
field types the API server checks (quantities, whole numbers that CEL reads), CEL rules, and the parts that more than
one field takes: a Secret's key, a model's source (the served model's, a draft's)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

# Kubernetes resource quantities ("500m", "16Gi", "2").
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
MODEL_URL_PATTERN = r"^(https?://[^/\s]+/|hf://[^/\s]+/[^/\s]+/|file:///)\S*\.gguf(@[^/\s@]+)?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]
# A whole number that a CEL rule reads. The API server hands CEL an `integer` field as an int and fails the rule on a
# whole number written with a decimal point (`1.0` arrives as float64: "expected int, got float64"), while it hands
# CEL a `number` field as a double however it was written; multipleOf keeps it whole, and the handlers' int takes 1.0.
WholeNumber = Annotated[int, Field(json_schema_extra={"type": "number", "multipleOf": 1})]


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """An x-kubernetes-validations entry: a CEL rule the API server evaluates on apply."""
    entry: JsonDict = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


class SpecPart(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_enum_values=False)


class SecretKeyRef(SpecPart):
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="Secret in the same namespace.")
    key: str = Field(default="token", min_length=1, max_length=253, description="Key within the Secret.")


class ModelSource(SpecPart):
    url: str = Field(
        pattern=MODEL_URL_PATTERN,
        max_length=2048,
        description=(
            "GGUF file: https://HOST/PATH.gguf, hf://ORG/REPO/PATH.gguf[@REVISION], file:///PATH.gguf, or "
            "http://HOST/PATH.gguf for a file server inside the cluster (never with a token)."
        ),
    )
    token_secret_ref: SecretKeyRef | None = Field(
        default=None, alias="tokenSecretRef", description="Bearer token for https:// or hf:// sources."
    )

    @model_validator(mode="after")
    def _token_only_over_tls(self) -> ModelSource:
        """The CEL rule again, for manifests that reach the handlers without the API server's check."""
        if self.token_secret_ref is not None and not self.url.startswith(("https://", "hf://")):
            raise ValueError("model.tokenSecretRef applies to https:// and hf:// sources only")
        return self
