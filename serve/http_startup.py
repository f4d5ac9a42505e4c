"""Rank 0's HTTP layer, started on a thread of its own while the gates run."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from serve.launch import LaunchConfig

log = logging.getLogger("serve")


class HttpStartupFailed(RuntimeError):
    """The HTTP layer did not come up (the port was taken meanwhile, an import failed)."""


class HttpStartup:
    """Rank 0's HTTP layer, imported and started on a thread of its own while the gates
    run (its imports cost about a second of CPU): liveness answers once it is up,
    readiness after admission. `wait()` returns (state, server) or raises."""

    def __init__(self, cfg: LaunchConfig, on_state: Callable[[Any], None]) -> None:
        self.cfg, self.on_state = cfg, on_state
        self.state: Any = None
        self.http: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="http-startup", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cfg = self.cfg
        try:
            from runtime.core.grammar import GrammarConfig
            from serve.api import ServerState, start_http_server

            grammar = GrammarConfig(compile_timeout_s=cfg.grammar_compile_timeout,
                                    compile_workers=cfg.grammar_compile_workers,
                                    cache_bytes=cfg.grammar_cache_mib << 20)
            state = ServerState(model_name="(starting)", tokenizer=None, max_seq_len=2,
                                max_queue=cfg.max_queue, max_body_bytes=cfg.max_body_bytes,
                                api_key=cfg.api_key, max_connections=cfg.max_connections,
                                header_timeout=cfg.header_timeout, grammar=grammar,
                                reasoning_parser=cfg.reasoning_parser,
                                tool_parser=cfg.tool_parser)
            self.on_state(state)
            self.http = start_http_server(state, cfg.host, cfg.port)
            self.state = state
            log.info("HTTP listening on http://%s:%d (liveness now, readiness after the gates)",
                     cfg.host, self.http.port)
        except BaseException as e:
            self.error = e

    def wait(self) -> tuple[Any, Any]:
        self.thread.join()
        if self.error is not None:
            raise HttpStartupFailed(str(self.error)) from self.error
        return self.state, self.http
