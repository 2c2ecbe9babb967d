"""Every client model carries exactly the fields of the server schema it is built from,
so a field the server adds is not silently dropped by `from_json` (and a client field is
never one the server does not send)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from pydantic import BaseModel

from ampwatch.client import models
from ampwatch.server.alerts import schemas as alert_schemas
from ampwatch.server.findings import schemas as analysis_schemas
from ampwatch.server.schemas import batches, common, runs, series
from ampwatch.server.schemas import bundles as bundle_schemas

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
