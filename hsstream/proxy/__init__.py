"""The serving proxy (``hsstream proxy``): clients point at it instead of at the serving vLLM.

It passes vLLM's OpenAI routes through unchanged, tees each finished request into the sidecar's
traffic jobs (what ``hsstream train --follow`` trains the draft on), and swaps the draft vLLM
serves without a restart the clients see. See docs/live-traffic.md.

================  ==========================================================================
``settings.py``   ``ProxySettings`` (``HSSTREAM_PROXY_*``)
``app.py``        the ASGI application: forwarding, disconnects, auth, the tee's buffer
``upstreams.py``  the live engine and those draining after a swap, with their draft versions
``samples.py``    a finished request + reply → the sample the sidecar tokenises
``tee.py``        the bounded queue and the thread that sends traffic jobs to the sidecar
``store.py``      what the proxy keeps (hashes, held-out slice, job ids) and for how long
``admin.py``      ``/admin/*``: state, swap (in place or blue/green), rollback, forget
``engines.py``    serving engines the proxy starts itself (managed mode)
``gate.py``       held-out acceptance of two drafts: whether a new one may go live
``serve.py``      building the proxy from its settings and running it under uvicorn
``cli.py``        the ``hsstream proxy`` commands
================  ==========================================================================
"""
