"""``lightq router``: one router process."""

from __future__ import annotations

from router.loop import Router
from shared.config import RouterSettings
from shared.redis import sync_client
from shared.service import default_id, setup_logging, stop_on_signals


def run(settings: RouterSettings) -> None:
    setup_logging()
    client = sync_client(settings.redis)
    router = Router(settings, client, default_id(settings.router_id))
    stop_on_signals(router.stop_event)
    try:
        router.run()
    finally:
        client.close()


def main() -> None:
    run(RouterSettings())


if __name__ == "__main__":
    main()
