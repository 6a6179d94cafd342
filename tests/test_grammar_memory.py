"""500 distinct hostile output constraints (regexes that explode llguidance's lexer, schemas
of thousands of properties) compiled against the default model's 49k-token vocabulary leave
the process's resident memory within 512 MB of where it started: refused grammars are freed
and given back, big ones are not cached, the cache stays within its byte budget."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from cpud.model.default_model import default_model_path
from cpud.settings.errors import RequestError
from cpud.structured.compiler import GrammarCompiler
from cpud.structured.matcher import SequenceConstraint
from cpud.structured.spec import StructuredSpec
from cpud.text.tokenizer import Tokenizer

BUDGET_MIB = 512


def vm_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def properties_schema(count: int, required: bool, tag: str) -> str:
    props = {f"{tag}_{i}": {"type": "string"} for i in range(count)}
    schema: dict = {"type": "object", "properties": props}
    if required:
        schema["required"] = list(props)
    return json.dumps(schema)


def hostile_specs() -> list[StructuredSpec]:
    specs = [
        StructuredSpec("regex", "a{1000}{1000}{" + str(n) + "}", source="guided_regex")
        for n in range(2, 402)
    ]
    specs += [
        StructuredSpec("json", properties_schema(10_000, False, f"o{i}"), source="guided_json")
        for i in range(50)
    ]
    specs += [StructuredSpec("json", properties_schema(3000, True, f"r{i}")) for i in range(50)]
    return specs


def test_500_hostile_grammars_leave_rss_within_budget():
    compiler = GrammarCompiler(Tokenizer(default_model_path()))
    compiler.check(StructuredSpec("regex", "[0-9]+"))  # the tokenizer converted, warm
    idle = vm_rss_mib()
    specs = hostile_specs()
    assert len({(s.kind, s.value) for s in specs}) == 500
    peak = idle

    def send(spec: StructuredSpec) -> str:
        try:  # what a request makes of it: a matcher and its first mask
            SequenceConstraint(compiler.matcher(spec)).allowed_mask()
        except RequestError as exc:
            assert exc.param == spec.source
            return "refused"
        return "compiled"

    outcomes: dict[str, int] = {}
    with ThreadPoolExecutor(4) as clients:  # four clients at once, as a server sees them
        for outcome in clients.map(send, specs):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            peak = max(peak, vm_rss_mib())
    end = vm_rss_mib()
    print(f"RSS idle {idle:.0f} MiB, peak +{peak - idle:.0f}, end +{end - idle:.0f}; {outcomes}")
    assert outcomes["refused"] >= 450  # every regex and every 10k-property schema
    assert peak - idle < BUDGET_MIB and end - idle < BUDGET_MIB
    assert compiler.stats().cache_bytes <= compiler.limits.cache_bytes
