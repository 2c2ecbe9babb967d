"""Python client for the ampwatch REST API, and the `ampwatch` command line.

    from ampwatch.client import Client

    with Client("http://127.0.0.1:8000", token="...") as ampwatch:
        for run in ampwatch.runs(status="critical"):
            print(run.name, run.loss_scale, ampwatch.findings(run.id))

docs/client.md describes every method and command.
"""

from ampwatch.client.api import DEFAULT_SERVER, Client
from ampwatch.client.errors import (
    AmpwatchError,
    AnalysisPending,
    BadRequest,
    ConnectionFailed,
    NotFound,
    ServerError,
    Unauthorized,
)
from ampwatch.client.models import (
    AlertAttempt,
    AlertRule,
    Alerts,
    AlertTarget,
    BatchAck,
    BisectVerdict,
    BundleInfo,
    Delivery,
    Factor,
    FactorSide,
    Finding,
    Health,
    Incident,
    Layer,
    LayerMatrix,
    LayerPoint,
    LayerSeries,
    LayerSummary,
    ProjectHealth,
    ProjectRun,
    RankTotals,
    Records,
    Run,
    Spike,
    Step,
)

__all__ = [
    # the client
    "Client",
    "DEFAULT_SERVER",
    # errors: AmpwatchError and its subclasses
    "AmpwatchError",
    "AnalysisPending",
    "BadRequest",
    "ConnectionFailed",
    "NotFound",
    "ServerError",
    "Unauthorized",
    # results
    "AlertAttempt",
    "AlertRule",
    "AlertTarget",
    "Alerts",
    "BatchAck",
    "BisectVerdict",
    "BundleInfo",
    "Delivery",
    "Factor",
    "FactorSide",
    "Finding",
    "Health",
    "Incident",
    "Layer",
    "LayerMatrix",
    "LayerPoint",
    "LayerSeries",
    "LayerSummary",
    "ProjectHealth",
    "ProjectRun",
    "RankTotals",
    "Records",
    "Run",
    "Spike",
    "Step",
]
