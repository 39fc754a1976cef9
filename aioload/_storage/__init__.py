"""Where bytes come from: ``storage`` (local files, URLs, object stores behind one
``Storage``), ``http`` (aiohttp GETs), ``fsspec``, ``retry``, ``cache`` (in memory) and
``diskcache`` (a shared folder), ``mounts`` (which local paths are network file systems) and
``scope`` (sessions that live as long as an event loop).
"""
