//! The NaCl primitives libzmq's CURVE mechanism calls, in Rust.
//!
//! libzmq is built from source with `ZMQ_HAVE_CURVE` and `ZMQ_USE_TWEETNACL`
//! (`.cargo/config.toml`), which makes it call the classic NaCl C API
//! (`crypto_box`, `crypto_secretbox`, `randombytes`, ...) but compile no
//! implementation of it. These functions are that implementation, over
//! RustCrypto's audited X25519, XSalsa20 and Poly1305 crates. The layouts
//! are NaCl's "zero-padded" ones: a plaintext starts with 32 zero bytes, a
//! ciphertext with 16 zero bytes and then the 16-byte tag.
//!
//! [`link`] must be reachable from every program that creates a zmq context
//! (`super::new_context` calls it), so that the linker keeps this module.

use std::os::raw::{c_int, c_uchar, c_ulonglong};

/// A C output buffer.
type Out = *mut c_uchar;
/// A C input buffer.
type In = *const c_uchar;
/// A C buffer length.
type Len = c_ulonglong;

use poly1305::Poly1305;
use poly1305::universal_hash::KeyInit;
use salsa20::XSalsa20;
use salsa20::cipher::{KeyIvInit, StreamCipher};
use subtle::ConstantTimeEq;

const KEY: usize = 32;
const NONCE: usize = 24;
const ZERO: usize = 32;
const BOX_ZERO: usize = 16;

/// Keeps the primitives in the link: call before libzmq needs them.
pub(crate) fn link() {
    let table: [*const (); 12] = [
        randombytes as *const (),
        randombytes_close as *const (),
        sodium_init as *const (),
        crypto_box_keypair as *const (),
        crypto_box_beforenm as *const (),
        crypto_box_afternm as *const (),
        crypto_box_open_afternm as *const (),
        crypto_box as *const (),
        crypto_box_open as *const (),
        crypto_scalarmult_base as *const (),
        crypto_secretbox as *const (),
        crypto_secretbox_open as *const (),
    ];
    std::hint::black_box(table);
}

/// Fills `out` with random bytes from the operating system.
pub(crate) fn fill_random(out: &mut [u8]) {
    use rand::RngCore;
    if rand::rngs::OsRng.try_fill_bytes(out).is_err() {
        // The OS generator failed (it essentially never does); the
        // thread-local generator is a CSPRNG seeded from it earlier.
        rand::thread_rng().fill_bytes(out);
    }
}

/// X25519 of `scalar` with `point`.
pub(crate) fn scalarmult(scalar: &[u8; KEY], point: &[u8; KEY]) -> [u8; KEY] {
    x25519_dalek::x25519(*scalar, *point)
}

/// X25519 public key of `scalar`.
pub(crate) fn public_key(scalar: &[u8; KEY]) -> [u8; KEY] {
    scalarmult(scalar, &x25519_dalek::X25519_BASEPOINT_BYTES)
}

/// NaCl `crypto_box_beforenm`: HSalsa20 of the X25519 shared secret.
fn beforenm(public: &[u8; KEY], secret: &[u8; KEY]) -> [u8; KEY] {
    let shared = scalarmult(secret, public);
    salsa20::hsalsa::<salsa20::cipher::consts::U10>(&shared.into(), &[0u8; 16].into()).into()
}

/// NaCl `crypto_secretbox` on slices: `m` and `c` have the same length >= 32.
fn secretbox(c: &mut [u8], m: &[u8], nonce: &[u8; NONCE], key: &[u8; KEY]) -> bool {
    if m.len() < ZERO || c.len() != m.len() {
        return false;
    }
    c.copy_from_slice(m);
    XSalsa20::new(key.into(), nonce.into()).apply_keystream(c);
    let (head, body) = c.split_at_mut(ZERO);
    let mut auth_key = [0u8; KEY];
    auth_key.copy_from_slice(head);
    let tag = Poly1305::new(&auth_key.into()).compute_unpadded(body);
    head[BOX_ZERO..].copy_from_slice(&tag);
    head[..BOX_ZERO].fill(0);
    true
}

/// NaCl `crypto_secretbox_open` on slices; false when the tag does not verify.
fn secretbox_open(m: &mut [u8], c: &[u8], nonce: &[u8; NONCE], key: &[u8; KEY]) -> bool {
    if c.len() < ZERO || m.len() != c.len() {
        return false;
    }
    let mut stream = XSalsa20::new(key.into(), nonce.into());
    let mut auth_key = [0u8; KEY];
    stream.apply_keystream(&mut auth_key);
    let tag = Poly1305::new(&auth_key.into()).compute_unpadded(&c[ZERO..]);
    if !bool::from(tag.as_slice().ct_eq(&c[BOX_ZERO..ZERO])) {
        return false;
    }
    m[ZERO..].copy_from_slice(&c[ZERO..]);
    stream.apply_keystream(&mut m[ZERO..]);
    m[..ZERO].fill(0);
    true
}

/// Reads a fixed-size array behind a C pointer.
///
/// # Safety
/// `p` must point to `N` readable bytes.
unsafe fn array<const N: usize>(p: In) -> [u8; N] {
    let mut out = [0u8; N];
    // SAFETY: the caller guarantees `N` readable bytes at `p`; `out` is a
    // distinct local array.
    unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), N) };
    out
}

/// Writes a fixed-size array behind a C pointer.
///
/// # Safety
/// `p` must point to `N` writable bytes.
unsafe fn put<const N: usize>(p: Out, v: &[u8; N]) {
    // SAFETY: the caller guarantees `N` writable bytes at `p`.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), p, N) };
}

/// Runs a padded box operation over C buffers of `d` bytes.
///
/// # Safety
/// `out` must be writable and `input` readable for `d` bytes; they may be
/// the same buffer (libzmq never passes partially overlapping ones).
unsafe fn padded(out: Out, input: In, d: Len, f: impl FnOnce(&mut [u8], &[u8]) -> bool) -> c_int {
    let Ok(d) = usize::try_from(d) else {
        return -1;
    };
    if d < ZERO || out.is_null() || input.is_null() {
        return -1;
    }
    // SAFETY: the caller guarantees `d` readable bytes at `input`; the copy
    // makes in-place calls (out == input) sound.
    let src = unsafe { std::slice::from_raw_parts(input, d) }.to_vec();
    let mut dst = vec![0u8; d];
    if !f(&mut dst, &src) {
        return -1;
    }
    // SAFETY: the caller guarantees `d` writable bytes at `out`.
    unsafe { std::ptr::copy_nonoverlapping(dst.as_ptr(), out, d) };
    0
}

/// NaCl `randombytes`.
///
/// # Safety
/// `x` must point to `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn randombytes(x: Out, len: Len) {
    let Ok(len) = usize::try_from(len) else {
        return;
    };
    if x.is_null() || len == 0 {
        return;
    }
    // SAFETY: the caller guarantees `len` writable bytes at `x`.
    let out = unsafe { std::slice::from_raw_parts_mut(x, len) };
    fill_random(out);
}

/// Closes the random source (nothing to close here).
#[unsafe(no_mangle)]
pub extern "C" fn randombytes_close() -> c_int {
    0
}

/// Initialises the library (nothing to initialise here).
#[unsafe(no_mangle)]
pub extern "C" fn sodium_init() -> c_int {
    0
}

/// NaCl `crypto_box_keypair`: a fresh key pair.
///
/// # Safety
/// `pk` and `sk` must each point to 32 writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn crypto_box_keypair(pk: Out, sk: Out) -> c_int {
    let mut secret = [0u8; KEY];
    fill_random(&mut secret);
    let public = public_key(&secret);
    // SAFETY: the caller guarantees 32 writable bytes at each.
    unsafe {
        put(sk, &secret);
        put(pk, &public);
    }
    0
}

/// NaCl `crypto_scalarmult_base`.
///
/// # Safety
/// `q` must point to 32 writable bytes and `n` to 32 readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn crypto_scalarmult_base(q: Out, n: In) -> c_int {
    // SAFETY: the caller guarantees 32 bytes at each.
    unsafe { put(q, &public_key(&array(n))) };
    0
}

/// NaCl `crypto_box_beforenm`.
///
/// # Safety
/// `k` must point to 32 writable bytes, `pk` and `sk` to 32 readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn crypto_box_beforenm(k: Out, pk: In, sk: In) -> c_int {
    // SAFETY: the caller guarantees 32 bytes at each.
    unsafe { put(k, &beforenm(&array(pk), &array(sk))) };
    0
}

/// NaCl `crypto_secretbox`.
///
/// # Safety
/// `c` writable and `m` readable for `d` bytes, `n` 24 and `k` 32 readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn crypto_secretbox(c: Out, m: In, d: Len, n: In, k: In) -> c_int {
    // SAFETY: the caller guarantees the sizes above.
    let (nonce, key) = unsafe { (array::<NONCE>(n), array::<KEY>(k)) };
    // SAFETY: as above.
    unsafe { padded(c, m, d, |c, m| secretbox(c, m, &nonce, &key)) }
}

/// NaCl `crypto_secretbox_open`; -1 when the ciphertext is forged.
///
/// # Safety
/// `m` writable and `c` readable for `d` bytes, `n` 24 and `k` 32 readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn crypto_secretbox_open(m: Out, c: In, d: Len, n: In, k: In) -> c_int {
    // SAFETY: the caller guarantees the sizes above.
    let (nonce, key) = unsafe { (array::<NONCE>(n), array::<KEY>(k)) };
    // SAFETY: as above.
    unsafe { padded(m, c, d, |m, c| secretbox_open(m, c, &nonce, &key)) }
}

/// NaCl `crypto_box_afternm` (a secretbox under the precomputed key).
///
/// # Safety
/// As [`crypto_secretbox`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn crypto_box_afternm(c: Out, m: In, d: Len, n: In, k: In) -> c_int {
    // SAFETY: same contract as crypto_secretbox.
    unsafe { crypto_secretbox(c, m, d, n, k) }
}

/// NaCl `crypto_box_open_afternm`.
///
/// # Safety
/// As [`crypto_secretbox_open`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn crypto_box_open_afternm(m: Out, c: In, d: Len, n: In, k: In) -> c_int {
    // SAFETY: same contract as crypto_secretbox_open.
    unsafe { crypto_secretbox_open(m, c, d, n, k) }
}

/// NaCl `crypto_box`.
///
/// # Safety
/// `c` writable and `m` readable for `d` bytes, `n` 24, `pk` and `sk` 32 readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn crypto_box(c: Out, m: In, d: Len, n: In, pk: In, sk: In) -> c_int {
    // SAFETY: the caller guarantees the sizes above.
    let (nonce, key) = unsafe { (array::<NONCE>(n), beforenm(&array(pk), &array(sk))) };
    // SAFETY: as above.
    unsafe { padded(c, m, d, |c, m| secretbox(c, m, &nonce, &key)) }
}

/// NaCl `crypto_box_open`; -1 when the ciphertext is forged.
///
/// # Safety
/// `m` writable and `c` readable for `d` bytes, `n` 24, `pk` and `sk` 32 readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn crypto_box_open(m: Out, c: In, d: Len, n: In, pk: In, sk: In) -> c_int {
    // SAFETY: the caller guarantees the sizes above.
    let (nonce, key) = unsafe { (array::<NONCE>(n), beforenm(&array(pk), &array(sk))) };
    // SAFETY: as above.
    unsafe { padded(m, c, d, |m, c| secretbox_open(m, c, &nonce, &key)) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crypto_box::aead::{Aead, AeadCore};
    use proptest::prelude::*;

    fn keypair(seed: u8) -> ([u8; 32], [u8; 32]) {
        let sk = [seed; 32];
        (public_key(&sk), sk)
    }

    proptest! {
        /// Our zero-padded box equals RustCrypto's `SalsaBox` (libsodium's
        /// "easy" layout: tag then ciphertext) after the 16 zero bytes, and
        /// opens back; a flipped bit is refused.
        #[test]
        fn box_matches_an_independent_implementation(
            msg in proptest::collection::vec(any::<u8>(), 0..300),
            nonce in any::<[u8; 24]>(),
            a in 1u8..=255, b in 1u8..=255, flip in any::<usize>(),
        ) {
            let (apk, ask) = keypair(a);
            let (bpk, bsk) = keypair(b);
            let mut m = vec![0u8; ZERO];
            m.extend_from_slice(&msg);
            let mut c = vec![0u8; m.len()];
            // SAFETY: every buffer has the size the call requires.
            let rc = unsafe {
                crypto_box(c.as_mut_ptr(), m.as_ptr(), m.len() as u64, nonce.as_ptr(), bpk.as_ptr(), ask.as_ptr())
            };
            prop_assert_eq!(rc, 0);
            prop_assert_eq!(&c[..BOX_ZERO], &[0u8; BOX_ZERO][..]);
            let theirs = crypto_box::SalsaBox::new(&bpk.into(), &ask.into())
                .encrypt(&nonce.into(), msg.as_slice())
                .unwrap();
            prop_assert_eq!(&c[BOX_ZERO..], theirs.as_slice());
            let mut back = vec![0u8; c.len()];
            // SAFETY: as above.
            let rc = unsafe {
                crypto_box_open(back.as_mut_ptr(), c.as_ptr(), c.len() as u64, nonce.as_ptr(), apk.as_ptr(), bsk.as_ptr())
            };
            prop_assert_eq!(rc, 0);
            prop_assert_eq!(&back, &m);
            let i = BOX_ZERO + flip % (c.len() - BOX_ZERO);
            c[i] ^= 1;
            // SAFETY: as above.
            let rc = unsafe {
                crypto_box_open(back.as_mut_ptr(), c.as_ptr(), c.len() as u64, nonce.as_ptr(), apk.as_ptr(), bsk.as_ptr())
            };
            prop_assert_eq!(rc, -1);
        }
    }

    #[test]
    fn precomputed_key_equals_the_one_shot_box() {
        let (apk, ask) = keypair(7);
        let (bpk, bsk) = keypair(9);
        let mut k1 = [0u8; 32];
        let mut k2 = [0u8; 32];
        // SAFETY: 32-byte buffers everywhere.
        unsafe {
            crypto_box_beforenm(k1.as_mut_ptr(), bpk.as_ptr(), ask.as_ptr());
            crypto_box_beforenm(k2.as_mut_ptr(), apk.as_ptr(), bsk.as_ptr());
        }
        assert_eq!(k1, k2, "both sides derive the same key");
        let nonce = crypto_box::SalsaBox::generate_nonce(&mut rand::rngs::OsRng);
        let m = [0u8; 40];
        let (mut c1, mut c2) = ([0u8; 40], [0u8; 40]);
        // SAFETY: 40-byte message and ciphertexts, 24-byte nonce, 32-byte keys.
        unsafe {
            crypto_box_afternm(c1.as_mut_ptr(), m.as_ptr(), 40, nonce.as_ptr(), k1.as_ptr());
            crypto_box(
                c2.as_mut_ptr(),
                m.as_ptr(),
                40,
                nonce.as_ptr(),
                bpk.as_ptr(),
                ask.as_ptr(),
            );
        }
        assert_eq!(c1, c2);
        // SAFETY: a 31-byte box is refused before any access past it.
        let short = unsafe {
            crypto_box_afternm(c1.as_mut_ptr(), m.as_ptr(), 31, nonce.as_ptr(), k1.as_ptr())
        };
        assert_eq!(short, -1);
    }
}
