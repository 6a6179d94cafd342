"""llama.cpp's llama-server as a peer: one server process per configuration, asked for greedy
completions of given token ids, its decode rate read from the answer's own timings.

    with LlamaServer(ServerConfig(gguf, threads=2, spec=NgramSpec(k=4, n=2))) as server:
        result = server.complete(prompt_ids, max_tokens=160)
        result.decode_tok_s, result.draft_n, result.draft_accepted

`timings.predicted_per_second` is (generated tokens - 1) over the time from the first token
to the last (llama-server's server_slot_stats: the first token comes from the prompt's
batch), the same definition as cpud's benches. Speculation (llama-server b11434):
- n-gram: `--spec-type ngram-simple` looks up the last n tokens (`--spec-ngram-simple-size-n`,
  one n, latest occurrence) and drafts the m that followed (`--spec-ngram-simple-size-m` = k);
  it drafts nothing when fewer than n tokens follow the match.
- draft model: `--spec-type draft-simple -md FILE --spec-draft-n-max k`, greedy drafts.
The binary comes from perf/peers/llamacpp.py's ensure_built().
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class NgramSpec:
    k: int  # tokens drafted per step (-m of ngram-simple)
    n: int = 2  # lookup n-gram length
    kind: str = "ngram-simple"

    def args(self) -> list[str]:
        size = f"--spec-{self.kind}-size"
        return ["--spec-type", self.kind, f"{size}-n", str(self.n), f"{size}-m", str(self.k)]


@dataclass(frozen=True)
class DraftSpec:
    model: Path  # the draft GGUF
    k: int

    def args(self) -> list[str]:
        model, k = str(self.model), str(self.k)
        return ["--spec-type", "draft-simple", "-md", model, "--spec-draft-n-max", k]


@dataclass(frozen=True)
class ServerConfig:
    gguf: Path
    threads: int = 2
    ctx: int = 4096
    spec: NgramSpec | DraftSpec | None = None
    extra: tuple[str, ...] = ()
    omp_wait: str | None = None  # OMP_WAIT_POLICY; None: llama.cpp's default

    def describe(self) -> str:
        spec = "no speculation" if self.spec is None else " ".join(self.spec.args())
        return f"llama-server -t {self.threads} -c {self.ctx} {spec}"


@dataclass(frozen=True)
class Completion:
    decode_tok_s: float
    tokens: int
    draft_n: int = 0
    draft_accepted: int = 0
    token_ids: list[int] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """A running llama-server (a context manager: started on enter, stopped on exit)."""

    def __init__(self, config: ServerConfig, bin_dir: Path | None = None, log: Path | None = None):
        self.config = config
        self.bin_dir = bin_dir
        self.log = log
        self.port = 0
        self.process: subprocess.Popen | None = None  # type: ignore[type-arg]

    def command(self, exe: Path) -> list[str]:
        config = self.config
        cmd = [str(exe), "-m", str(config.gguf), "-t", str(config.threads)]
        cmd += ["-c", str(config.ctx), "-np", "1", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--no-webui"]
        if config.spec is not None:
            cmd += config.spec.args()
        return [*cmd, *config.extra]

    def __enter__(self) -> LlamaServer:
        if self.bin_dir is None:
            from llamacpp import ensure_built

            self.bin_dir = ensure_built()
        self.port = free_port()
        env = dict(os.environ)
        if self.config.omp_wait:
            env["OMP_WAIT_POLICY"] = self.config.omp_wait
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.process = subprocess.Popen(
            self.command(self.bin_dir / "llama-server"), stdout=out, stderr=out, env=env
        )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited while starting ({self.config.describe()}); "
                    f"see {self.log or 'its output (pass log=)'}"
                )
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"llama-server not ready in {START_TIMEOUT_S:.0f} s")

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, prompt_ids: list[int], max_tokens: int) -> Completion:
        """A greedy completion of the token ids (the server's prompt cache off)."""
        body = {
            "prompt": prompt_ids,
            "n_predict": max_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
        }
        request = urllib.request.Request(
            self._url("/completion"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as reply:
            answer = json.loads(reply.read())
        timings = answer["timings"]
        return Completion(
            decode_tok_s=float(timings["predicted_per_second"]),
            tokens=int(timings["predicted_n"]),
            draft_n=int(timings.get("draft_n", 0)),
            draft_accepted=int(timings.get("draft_n_accepted", 0)),
            token_ids=list(answer.get("tokens", [])),
        )
