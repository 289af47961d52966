"""Label spaces shared by the tasks, the synthetic generator and the data checks (one definition).

The five label kinds a curated dataset carries (one per task); body-part classes are the 29 of
the Sapiens2 segmentation head (left/right are the person's own), pixels without a label carry
`IGNORE_INDEX`; keypoints are the 17 COCO body keypoints with their OKS sigmas, limbs and
left/right flip pairs. The 308-keypoint and 238-point face sets are the sibling modules.
`sapiens2.data` and `sapiens2.tasks` both read labels from here; `data` imports nothing of `tasks`.
"""

# The order the platform runs and reports tasks in; `sapiens2.tasks.registry` maps each to its task.
TASK_NAMES: tuple[str, ...] = ("pose", "seg", "normal", "pointmap", "albedo")

SEG_CLASSES: tuple[str, ...] = (
    "Background", "Apparel", "Eyeglass", "Face_Neck", "Hair",
    "Left_Foot", "Left_Hand", "Left_Lower_Arm", "Left_Lower_Leg", "Left_Shoe",
    "Left_Sock", "Left_Upper_Arm", "Left_Upper_Leg", "Lower_Clothing", "Right_Foot",
    "Right_Hand", "Right_Lower_Arm", "Right_Lower_Leg", "Right_Shoe", "Right_Sock",
    "Right_Upper_Arm", "Right_Upper_Leg", "Torso", "Upper_Clothing", "Lower_Lip",
    "Upper_Lip", "Lower_Teeth", "Upper_Teeth", "Tongue",
)


def mirror_class_map(names: tuple[str, ...]) -> tuple[int, ...]:
    """Class permutation under a horizontal flip: Left_X <-> Right_X, others fixed."""
    index = {n: i for i, n in enumerate(names)}
    swap = {"Left_": "Right_", "Right_": "Left_"}
    out = []
    for n in names:
        prefix = next((p for p in swap if n.startswith(p)), None)
        out.append(index[swap[prefix] + n[len(prefix):]] if prefix else index[n])
    return tuple(out)


SEG_FLIP: tuple[int, ...] = mirror_class_map(SEG_CLASSES)
IGNORE_INDEX = 255  # a seg pixel without a label: no loss, not scored

COCO_KEYPOINT_NAMES: tuple[str, ...] = (
    "nose", "left_eye", "right_eye", "left_ear", "right_ear",
    "left_shoulder", "right_shoulder", "left_elbow", "right_elbow", "left_wrist", "right_wrist",
    "left_hip", "right_hip", "left_knee", "right_knee", "left_ankle", "right_ankle",
)
COCO_OKS_SIGMAS: tuple[float, ...] = (
    0.026, 0.025, 0.025, 0.035, 0.035, 0.079, 0.079, 0.072, 0.072,
    0.062, 0.062, 0.107, 0.107, 0.087, 0.087, 0.089, 0.089,
)
COCO_FLIP_PAIRS: tuple[tuple[int, int], ...] = (
    (1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16),
)
COCO_SKELETON: tuple[tuple[int, int], ...] = (
    (15, 13), (13, 11), (16, 14), (14, 12), (11, 12), (5, 11), (6, 12), (5, 6), (5, 7),
    (6, 8), (7, 9), (8, 10), (1, 2), (0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6),
)
