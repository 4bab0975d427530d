"""Test support for the real engines: availability policy, running servers, a byte tap, stream clients."""
