"""Write the built-in demo dataset: shapes on textured backgrounds.

Each image holds a few circles, squares and triangles (the three classes) in
random colours, sizes and positions, possibly overlapping, on a textured
background. A shape's colour is drawn independently of its class, so only its
shape tells the class. The truth is known exactly:

    OUT_DIR/
      images/{train,val}/NNNNN.jpg                    the images
      annotations/instances_{train,val}.json          COCO instances (boxes, RLE masks
                                                      of the visible part)
      ade/images/{training,validation}/NNNNN.jpg      ADE20K layout (links to images/)
      ade/annotations/{training,validation}/NNNNN.png semantic labels: 0 background,
                                                      1 circle, 2 square, 3 triangle
      cls/{train,val}/{circle,square,triangle}/NNNNN.jpg
                                                      classification (ImageFolder layout):
                                                      one shape per image

Usage: python tools/make_demo_data.py [OUT_DIR] [--train N] [--val N] [--size S]
The output is deterministic for given arguments and seed.
"""
import argparse
import json
import os
import os.path as osp

import cv2
import numpy as np
from pycocotools import mask as mask_utils

CLASSES = ('circle', 'square', 'triangle')


def textured_background(rng: np.random.Generator, size: int) -> np.ndarray:
    """Low-frequency colour gradients plus stripes plus pixel noise."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    img = np.zeros((size, size, 3), np.float32)
    for c in range(3):
        a, b, ph = rng.uniform(-1, 1, 3)
        img[..., c] = 110 + 50 * (a * xx + b * yy) + 25 * np.sin(
            2 * np.pi * (rng.uniform(2, 6) * (xx * np.cos(ph) + yy * np.sin(ph))))
    img += rng.normal(0, 12, img.shape)
    return img


def draw_shape(rng: np.random.Generator, size: int, label: int):
    """A filled shape mask (uint8 H x W) of class ``label``."""
    mask = np.zeros((size, size), np.uint8)
    r = rng.uniform(0.09, 0.2) * size  # half extent
    cx, cy = rng.uniform(r, size - r, 2)
    if label == 0:  # circle
        cv2.circle(mask, (int(round(cx)), int(round(cy))), int(round(r)), 1, -1)
    elif label == 1:  # square, any rotation
        angle = rng.uniform(0, 90)
        box = cv2.boxPoints(((cx, cy), (2 * r * 0.9, 2 * r * 0.9), angle))
        cv2.fillPoly(mask, [np.round(box).astype(np.int32)], 1)
    else:  # triangle: equilateral, any rotation
        t0 = rng.uniform(0, 2 * np.pi)
        pts = [(cx + r * np.cos(t0 + k * 2 * np.pi / 3), cy + r * np.sin(t0 + k * 2 * np.pi / 3))
               for k in range(3)]
        cv2.fillPoly(mask, [np.round(pts).astype(np.int32)], 1)
    return mask


def make_image(rng: np.random.Generator, size: int):
    img = textured_background(rng, size)
    n = rng.integers(2, 5)
    labels, masks = [], []
    for _ in range(n):
        label = int(rng.integers(0, 3))
        m = draw_shape(rng, size, label)
        colour = rng.uniform(0, 255, 3)
        shade = rng.normal(0, 8, (size, size, 1))
        img = np.where(m[..., None] > 0, colour + shade, img)
        # later shapes occlude earlier ones
        masks = [prev & (1 - m) for prev in masks]
        labels.append(label)
        masks.append(m)
    img = np.clip(img, 0, 255).astype(np.uint8)
    semantic = np.zeros((size, size), np.uint8)
    for label, m in zip(labels, masks):
        semantic[m > 0] = label + 1
    return img, labels, masks, semantic


def write_split(out_dir: str, split: str, ade_split: str, count: int, size: int, seed: int):
    rng = np.random.default_rng(seed)
    img_dir = osp.join(out_dir, 'images', split)
    ade_img = osp.join(out_dir, 'ade', 'images', ade_split)
    ade_ann = osp.join(out_dir, 'ade', 'annotations', ade_split)
    for d in (img_dir, ade_img, ade_ann, osp.join(out_dir, 'annotations')):
        os.makedirs(d, exist_ok=True)
    images, annotations = [], []
    for idx in range(count):
        img, labels, masks, semantic = make_image(rng, size)
        name = f'{idx:05d}'
        cv2.imwrite(osp.join(img_dir, name + '.jpg'), img[..., ::-1],
                    [cv2.IMWRITE_JPEG_QUALITY, 95])
        link = osp.join(ade_img, name + '.jpg')
        if not osp.lexists(link):
            os.symlink(osp.relpath(osp.join(img_dir, name + '.jpg'), ade_img), link)
        cv2.imwrite(osp.join(ade_ann, name + '.png'), semantic)
        images.append(dict(id=idx, file_name=name + '.jpg', height=size, width=size))
        for label, m in zip(labels, masks):
            if m.sum() < 16:  # almost fully hidden
                continue
            rle = mask_utils.encode(np.asfortranarray(m))
            x, y, w, h = mask_utils.toBbox(rle).tolist()
            rle['counts'] = rle['counts'].decode('ascii')
            annotations.append(dict(
                id=len(annotations) + 1, image_id=idx, category_id=label + 1,
                segmentation=rle, area=float(mask_utils.area(rle)),
                bbox=[x, y, w, h], iscrowd=0))
    coco = dict(images=images, annotations=annotations,
                categories=[dict(id=i + 1, name=c) for i, c in enumerate(CLASSES)])
    with open(osp.join(out_dir, 'annotations', f'instances_{split}.json'), 'w') as f:
        json.dump(coco, f)
    return len(images), len(annotations)


def write_classification(out_dir: str, split: str, count: int, size: int, seed: int) -> int:
    """``count`` images of one shape each, filed by class (ImageFolder layout)."""
    rng = np.random.default_rng(seed)
    for name in CLASSES:
        os.makedirs(osp.join(out_dir, 'cls', split, name), exist_ok=True)
    for idx in range(count):
        label = idx % len(CLASSES)  # balanced classes
        img = textured_background(rng, size)
        m = draw_shape(rng, size, label)
        colour = rng.uniform(0, 255, 3)
        img = np.where(m[..., None] > 0, colour + rng.normal(0, 8, (size, size, 1)), img)
        img = np.clip(img, 0, 255).astype(np.uint8)
        cv2.imwrite(osp.join(out_dir, 'cls', split, CLASSES[label], f'{idx:05d}.jpg'),
                    img[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 95])
    return count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('out_dir', nargs='?', default='data/shapes')
    parser.add_argument('--train', type=int, default=800, help='training images')
    parser.add_argument('--val', type=int, default=100, help='validation images (>= 1)')
    parser.add_argument('--size', type=int, default=128, help='image side in pixels')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)
    if args.train < 1 or args.val < 1:
        parser.error(f'--train and --val must be >= 1, got {args.train} and {args.val}')
    if args.size < 32:
        parser.error(f'--size must be >= 32 pixels, got {args.size}')
    # disjoint splits: different seeds draw different images
    for split, ade, count, seed in (('train', 'training', args.train, args.seed),
                                    ('val', 'validation', args.val, args.seed + 1000003)):
        n_img, n_ann = write_split(args.out_dir, split, ade, count, args.size, seed)
        n_cls = write_classification(args.out_dir, split, count, args.size, seed + 7)
        print(f'{split}: {n_img} images, {n_ann} instances, {n_cls} classification '
              f'images -> {args.out_dir}')


if __name__ == '__main__':
    main()
