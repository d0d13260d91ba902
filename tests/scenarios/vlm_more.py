"""InternVL and Mistral 3 trained under SP (``tests/test_vlm_more.py``): the fits of
:mod:`tests.scenarios.vision_language`, with a spy that also reads pixels given by keyword (InternVL calls its vision
tower with ``pixel_values=``)."""

from __future__ import annotations

from tests.scenarios import vision_language


class KeywordVisionSpy(vision_language.VisionSpy):
    """:class:`~tests.scenarios.vision_language.VisionSpy`, the encoded pixel rows read positionally or by keyword."""

    def _encoded(self, module, args, kwargs) -> None:
        if self.steps:
            pixels = args[0] if args else kwargs["pixel_values"]
            self.steps[-1]["encoded_rows"].append(int(pixels.shape[0]))


def run(payload: dict) -> dict:
    vision_language.VisionSpy = KeywordVisionSpy  # this worker process runs these fits only
    return vision_language.run(payload)
