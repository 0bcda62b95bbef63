"""Every Prometheus family the server exports (k3's and vLLM's) is documented in docs/serving.md."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[3]


def test_every_metric_is_documented():
    source = (ROOT / "core" / "serve" / "metrics.py").read_text()
    families = set(re.findall(r'Family\(\s*"(k3:\w+)"', source)) | set(re.findall(r'(?:Histogram|Counter|Gauge)\(\s*"(k3:\w+)"', source))
    assert len(families) >= 15, families
    vllm = set(re.findall(r'"(vllm:\w+)"', (ROOT / "core" / "serve" / "vllm_metrics.py").read_text()))
    assert len(vllm) >= 25, vllm
    doc = (ROOT / "docs" / "serving.md").read_text()
    assert sorted(f for f in families | vllm if f not in doc) == []
