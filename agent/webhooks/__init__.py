"""Alert webhooks from the agent: Alertmanager v2 and signed generic JSON, through a durable outbox.

Wiring (in :class:`agent.sidecar.Sidecar`)::

    dispatcher = WebhookDispatcher(cfg.webhooks, exporter.registry)
    loop.subscribe(dispatcher.observe)
    dispatcher.start()          # in start()
    await dispatcher.stop()     # in stop()

Receivers of the generic webhook check messages with :func:`agent.webhooks.signing.verify`.
"""

from agent.webhooks.alerts import Alert, AlertTracker
from agent.webhooks.dispatcher import WebhookDispatcher, sinks_from_config
from agent.webhooks.outbox import Message, Outbox, OutboxError
from agent.webhooks.signing import SignatureError, decode_secret, decode_secrets, sign_headers, verify
from agent.webhooks.sinks import AlertmanagerSink, GenericSink

__all__ = [
    "Alert",
    "AlertTracker",
    "AlertmanagerSink",
    "GenericSink",
    "Message",
    "Outbox",
    "OutboxError",
    "SignatureError",
    "WebhookDispatcher",
    "decode_secret",
    "decode_secrets",
    "sign_headers",
    "sinks_from_config",
    "verify",
]
