"""select_frames, the transformers CLIP encoder and the `vlm-prune keyframes` command."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import vlm_prune
from vlm_prune.cli import main
from vlm_prune.frames.keyscore import HFImageTextEncoder, load_encoder

cv2 = pytest.importorskip("cv2")

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 40, 210)}


def colour_frames(per: int = 4, size: int = 16) -> np.ndarray:
    return np.stack([np.full((size, size, 3), c, dtype=np.uint8) for c in COLOURS.values() for _ in range(per)])


def colour_encoder(frames, texts):
    """Frame embedding = mean RGB; a caption naming a colour embeds as that colour."""
    emb = torch.from_numpy(frames.reshape(len(frames), -1, 3).mean(1)).float()
    return emb, torch.tensor([COLOURS[t] for t in texts], dtype=torch.float32)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> str:
    """A tiny random CLIPModel with its processor, saved as a checkpoint folder."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    torch.manual_seed(0)
    tower = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    cfg = CLIPConfig(
        text_config={**tower, "vocab_size": 64, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 1},
        vision_config={**tower, "image_size": 32, "patch_size": 8},
        projection_dim=8,
    )
    path = tmp_path_factory.mktemp("tiny_clip")
    CLIPModel(cfg).save_pretrained(path)
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=CLIPTokenizer(),
    )
    processor.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory) -> str:
    """A 20-frame 10 fps clip: 10 red frames, then 10 blue."""
    path = str(tmp_path_factory.mktemp("clips") / "rb.avi")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (32, 32))
    for colour in ((220, 30, 30),) * 10 + ((40, 40, 210),) * 10:
        writer.write(np.full((32, 32, 3), colour[::-1], dtype=np.uint8))  # BGR
    writer.release()
    return path


def test_select_frames_keyscore_on_an_array():
    sel = vlm_prune.select_frames(colour_frames(), "green", budget=1, encoder=colour_encoder)
    assert sel.candidates.tolist() == [1, 5, 9]  # STACFP: one medoid per colour segment
    assert sel.indices.tolist() == [5] and sel.timestamps is None
    assert sel.scores.shape == (1,) and sel.scores[0] == sel.candidate_scores.max()
    every = vlm_prune.select_frames(colour_frames(), "blue", budget=2, encoder=colour_encoder, proposals="all")
    assert every.candidates.tolist() == list(range(12)) and set(every.indices) <= {8, 9, 10, 11}


def test_select_frames_uniform_on_a_path(clip_file):
    sel = vlm_prune.select_frames(clip_file, method="uniform", budget=3, fps=5.0)
    assert sel.candidates.tolist() == list(range(10))  # 2 s at 5 frames a second
    assert sel.indices.tolist() == [0, 4, 9] and sel.scores is None
    np.testing.assert_allclose(sel.timestamps, [0.0, 0.8, 1.8])


def test_select_frames_errors():
    with pytest.raises(ValueError, match="needs an image-text encoder"):
        vlm_prune.select_frames(colour_frames(), "red")
    with pytest.raises(ValueError, match="method"):
        vlm_prune.select_frames(colour_frames(), "red", method="best")
    with pytest.raises(ValueError, match="uint8"):
        vlm_prune.select_frames(np.zeros((3, 4, 4)), "red", method="uniform")


def test_clip_encoder_from_a_saved_checkpoint(clip_dir):
    enc = load_encoder(clip_dir)
    frames = colour_frames(per=2)
    frame_emb, text_emb = enc(frames, ["a red car", "blue"])
    assert frame_emb.shape == (6, 8) and text_emb.shape == (2, 8)
    # batching does not change the embeddings
    enc.batch_size = 4
    torch.testing.assert_close(enc(frames, ["blue"])[0], frame_emb)
    sel = vlm_prune.select_frames(frames, "red", budget=2, encoder=clip_dir)
    assert len(sel.indices) == 2


def test_encoder_errors(tmp_path):
    with pytest.raises(ValueError, match="CLIP / SigLIP"):
        load_encoder(str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="image-text model"):
        HFImageTextEncoder(torch.nn.Linear(2, 2), processor=None)


def test_keyframes_cli(clip_dir, clip_file, tmp_path):
    captions = tmp_path / "captions.txt"
    captions.write_text("a red square\n")
    out = tmp_path / "scores.jsonl"
    rc = main(["keyframes", clip_file, str(tmp_path / "gone.mp4"), "--captions", str(captions),
               "--encoder", clip_dir, "--budget", "2", "--fps", "5", "--out", str(out)])
    assert rc == 1  # one video is missing; the other is still scored
    good, bad = [json.loads(line) for line in out.read_text().splitlines()]
    assert good["video"] == clip_file and len(good["indices"]) == 2 and len(good["scores"]) == 2
    assert set(good["indices"]) <= set(good["candidates"]) and len(good["timestamps"]) == 2
    assert "no video file" in bad["error"]
    rc = main(["keyframes", clip_file, "--method", "uniform", "--budget", "4", "--fps", "5", "--out", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0 and record["indices"] == [0, 3, 6, 9] and record["scores"] is None


def test_keyframes_cli_needs_encoder_and_captions(clip_file, capsys):
    assert main(["keyframes", clip_file]) == 2
    assert "--encoder" in capsys.readouterr().err


def test_captions_file_formats(tmp_path):
    from vlm_prune.frames.cli import read_captions

    lines = tmp_path / "c.txt"
    lines.write_text("one\n\ntwo\n")
    assert read_captions(str(lines), ["a.mp4", "b.mp4"]) == ["one", "two"]
    with pytest.raises(ValueError, match="2 captions for 3 videos"):
        read_captions(str(lines), ["a", "b", "c"])
    table = tmp_path / "c.json"
    table.write_text(json.dumps({"dir/a.mp4": "x", "b.mp4": "y"}))
    assert read_captions(str(table), ["dir/a.mp4", "other/b.mp4"]) == ["x", "y"]
    with pytest.raises(ValueError, match="no caption for z.mp4"):
        read_captions(str(table), ["z.mp4"])
