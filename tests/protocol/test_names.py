"""Names and formats both sides agree on keep their exact values (protocol.names)."""

import pickle

import torch

from dask_monarch.protocol import names


def test_executor_and_resource_names():
    assert names.executor_name("tok", 3) == "monarch-tok-3"
    assert names.executor_name("tok", "control") == "monarch-tok-control"
    assert names.executor_name("tok", 12).startswith(names.executor_prefix("tok"))
    assert not names.executor_name("tok2", 1).startswith(names.executor_prefix("tok"))
    assert names.rank_resource(2) == "monarch-rank2"
    assert names.worker_resource("w1") == "monarch-w1"
    assert names.rank_resource(0).startswith(names.RESOURCE_PREFIX)
    assert names.PLUGIN_NAME == "dask_monarch"


def test_output_description_round_trip():
    t = torch.zeros(3, 4, dtype=torch.float64)[:, 1:]
    description = names.describe_output(t)
    assert description == ("tensor", (3, 3), (4, 1), 1, torch.float64, "cpu")
    assert pickle.loads(pickle.dumps(description)) == description
    assert names.described_tensor(description) == (
        (3, 3),
        (4, 1),
        1,
        torch.float64,
        torch.device("cpu"),
    )
    assert names.describe_output(5) == ("value", 5)
    assert names.describe_output(5, keep_value=False) == ("value", None)
    assert names.described_tensor(("value", 5)) is None
