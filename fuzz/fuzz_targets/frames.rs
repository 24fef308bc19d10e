// Shared by the wire targets: splits fuzz input into multipart frames.
// Layout: a frame count byte, then per frame a u16 length and its bytes;
// whatever remains becomes the last frame. This lets libFuzzer explore
// frame boundaries as well as contents.
pub fn split(data: &[u8]) -> Vec<&[u8]> {
    let Some((&count, mut rest)) = data.split_first() else {
        return Vec::new();
    };
    let mut frames = Vec::new();
    for _ in 0..(count % 32) {
        if rest.len() < 2 {
            break;
        }
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
        rest = &rest[2..];
        let len = len.min(rest.len());
        frames.push(&rest[..len]);
        rest = &rest[len..];
    }
    frames.push(rest);
    frames
}
