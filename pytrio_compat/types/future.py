"""APIFuture: the handle every training call returns; blocks with .result() or is awaited."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, Generator, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class APIFuture(Generic[T]):
    """A thin wrapper over ``concurrent.futures.Future`` that any asyncio loop can await."""

    def __init__(self, future: concurrent.futures.Future | None = None) -> None:
        self._future: concurrent.futures.Future = future if future is not None else concurrent.futures.Future()

    @staticmethod
    def completed(value: T) -> "APIFuture[T]":
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(value)
        return APIFuture(fut)

    def result(self, timeout: float | None = None) -> T:
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as exc:
            raise TimeoutError(f"result not ready within {timeout} s") from exc

    async def result_async(self, timeout: float | None = None) -> T:
        return await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout=timeout)

    def cancel(self) -> bool:
        return self._future.cancel()

    def add_done_callback(self, fn: Callable[["APIFuture[T]"], Any]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def map(self, fn: Callable[[T], U]) -> "APIFuture[U]":
        out: concurrent.futures.Future = concurrent.futures.Future()

        def _forward(src: concurrent.futures.Future) -> None:
            if src.cancelled():
                out.cancel()
            elif src.exception() is not None:
                out.set_exception(src.exception())
            else:
                try:
                    out.set_result(fn(src.result()))
                except BaseException as exc:  # noqa: BLE001 - propagate the mapper's failure
                    out.set_exception(exc)

        def _cancel_back(dst: concurrent.futures.Future) -> None:
            if dst.cancelled():
                self._future.cancel()

        self._future.add_done_callback(_forward)
        out.add_done_callback(_cancel_back)
        return APIFuture(out)

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._future).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture {state}>"
