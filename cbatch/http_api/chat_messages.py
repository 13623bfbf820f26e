"""OpenAI chat messages as cbatch's {role, content} messages: the shared implementation
(cbatch.tools.messages), named here for the HTTP API's modules."""

from cbatch.tools.messages import cbatch_messages

__all__ = ["cbatch_messages"]
