"""Where bytes come from: ``storage`` (local files, URLs, object stores behind one
``Storage``), ``http`` (one HTTP request attempt: limits, redirects, errors) over ``h1`` (the
HTTP/1.1 client: connections and keep-alive pools), ``fsspec``, ``retry``, ``cache`` (in
memory) and ``diskcache`` (a shared folder), ``mounts`` (which local paths are network file
systems), ``scope`` (pools and clients that live as long as an event loop), ``versioned`` (files kept
per version of a file elsewhere: indexes, footers), ``cachedir`` (the folder they and generated
data live in, ``$AIOLOAD_CACHE``), ``nowait`` (local reads answered from the page cache
in the calling thread), ``buffers`` (buffers read into, reused once nobody holds them), ``arrived``
(bytes a read received beyond those it returns, for the statistics) and ``redact`` (URLs as
messages show them, without credentials).
"""
