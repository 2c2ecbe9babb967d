"""Every client model carries exactly the fields of the server schema it is built from,
so a field the server adds is not silently dropped by `from_json` (and a client field is
never one the server does not send)."""

from __future__ import annotations

import collections.abc
import dataclasses
import datetime
import enum
import inspect
import types
import typing
from typing import Any

import pytest
from pydantic import BaseModel

from ampwatch.client import models
from ampwatch.server.alerts import schemas as alert_schemas
from ampwatch.server.findings import schemas as analysis_schemas
from ampwatch.server.schemas import batches, common, runs, series
from ampwatch.server.schemas import bundles as bundle_schemas
from ampwatch.server.schemas import projects as project_schemas

# client model -> the server schema of the JSON it is built from
PAIRS: dict[type, type[BaseModel]] = {
    models.Health: common.HealthPublic,
    models.RankTotals: runs.RankPublic,
    models.Run: runs.RunPublic,
    models.Step: series.StepPublic,
    models.LayerSummary: series.LayerSummary,
    models.Layer: series.LayerPublic,
    models.LayerPoint: series.LayerPointPublic,
    models.LayerSeries: series.LayerSeriesPublic,
    models.LayerMatrix: series.MatrixPublic,
    models.TimelineEntry: analysis_schemas.TimelineEntryPublic,
    models.Incident: analysis_schemas.IncidentPublic,
    models.Finding: analysis_schemas.FindingPublic,
    models.Spike: analysis_schemas.SpikePublic,
    models.BatchAck: batches.BatchAck,
    models.AlertTarget: alert_schemas.AlertTargetPublic,
    models.AlertRule: alert_schemas.AlertRulePublic,
    models.Alerts: alert_schemas.AlertsPublic,
    models.AlertAttempt: alert_schemas.AlertAttemptPublic,
    models.Delivery: alert_schemas.DeliveryPublic,
    models.BundleInfo: bundle_schemas.BundlePublic,
    models.BisectVerdict: bundle_schemas.BisectVerdictPublic,
    models.ProjectRun: project_schemas.ProjectRunPublic,
    models.FactorSide: project_schemas.FactorSidePublic,
    models.Factor: project_schemas.FactorPublic,
    models.ProjectHealth: project_schemas.ProjectHealthPublic,
}


def test_every_client_model_is_paired():
    defined = {value for value in vars(models).values()
               if inspect.isclass(value) and issubclass(value, models.Model)
               and value is not models.Model and dataclasses.is_dataclass(value)}
    assert defined == set(PAIRS)


@pytest.mark.parametrize("client_model", list(PAIRS), ids=lambda m: m.__name__)
def test_client_fields_equal_the_server_schema(client_model):
    server = set(PAIRS[client_model].model_fields)
    client = {f.name for f in dataclasses.fields(client_model)}
    assert client == server, (f"only on the server: {sorted(server - client)}; "
                              f"only in the client: {sorted(client - server)}")


def test_every_step_field_is_accepted_stored_and_returned():
    """A per-step signal is one column of the stored steps: the batch schema accepts it,
    storage keeps it, the steps API and the client return it."""
    from ampwatch.server.store.series import SCALAR_FIELDS

    per_layer = {"layer_grad_norm", "layer_grad_zero_share", "activations", "fp8", "spikes"}
    assert set(batches.StepIn.model_fields) - per_layer == set(SCALAR_FIELDS)
    assert set(series.StepPublic.model_fields) == {"rank", *SCALAR_FIELDS}


def _shape(hint: Any) -> Any:
    """A type as both sides can state it: "int", "float", "str", "bool", "datetime",
    ("list", item), "dict", "model", "any"; a str Literal or enum is "str", and a wire
    float (a number or "NaN"/"Infinity") is "float". Optionality is `_nullable`'s."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _shape(args[0])
    if origin in (typing.Union, types.UnionType):
        shapes = {_shape(a) for a in args if a is not type(None)}
        shapes.discard("wire-nonfinite")
        return shapes.pop() if len(shapes) == 1 else tuple(sorted(map(str, shapes)))
    if origin is typing.Literal:
        if set(args) <= {"NaN", "Infinity", "-Infinity"}:
            return "wire-nonfinite"
        return {type(a).__name__ for a in args}.pop()
    if origin in (list, tuple, collections.abc.Sequence):
        items = {_shape(a) for a in args if a is not Ellipsis}
        return ("list", items.pop() if len(items) == 1 else "any")
    if origin is dict or hint is dict:
        return "dict"
    if hint is Any:
        return "any"
    if inspect.isclass(hint):
        if issubclass(hint, enum.Enum):
            return "str"
        if issubclass(hint, BaseModel) or dataclasses.is_dataclass(hint):
            return "model"
        if hint in (int, float, str, bool, datetime.datetime):
            return hint.__name__
    return "any"


def _nullable(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _comparable(a: Any, b: Any) -> bool:
    if "any" in (a, b):
        return True
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0] == "list":
        return _comparable(a[1], b[1])
    return a == b


@pytest.mark.parametrize("client_model", list(PAIRS), ids=lambda m: m.__name__)
def test_client_field_types_follow_the_server_schema(client_model):
    """Each field has the server's type (where the two can be compared), and accepts null
    wherever the server may send it."""
    client_hints = typing.get_type_hints(client_model)
    wrong = []
    for name, info in PAIRS[client_model].model_fields.items():
        server, client = info.annotation, client_hints[name]
        if not _comparable(_shape(server), _shape(client)):
            wrong.append(f"{name}: server {_shape(server)}, client {_shape(client)}")
        elif _nullable(server) and not _nullable(client):
            wrong.append(f"{name}: the server may send null, the client does not take it")
    assert not wrong, wrong
