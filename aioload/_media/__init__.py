"""Video and audio, decoded in the workers with torchcodec: ``clips`` (which frames make a clip,
a pure function of the video's length and the seeded generator), ``probe`` (what a video holds
and, for MP4, where each frame's bytes lie), ``source`` (the bytes a clip needs: a local path, a
range of a remote MP4, or a whole file), ``decoders`` (torchcodec's decoders, kept open per
file within a worker, and their errors), ``frombytes`` (a clip or an audio crop from bytes in
memory), ``video`` (``VideoFolder``, ``VideoFiles``), ``audio`` (``AudioFiles``) and ``synth``
(generated videos and sounds for examples, tests and benchmarks).
"""
