"""The JetStream wire: API subjects and error codes, the ordered replay, the bulk-read transport, durable consumers.

Everything that speaks JetStream's protocol below nats-py's public client
lives here, once; the rest of the framework goes through these modules.
"""
