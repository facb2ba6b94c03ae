//! Checkpoints: the fleet's caches on disk, so a restarted sidecar knows what the engines
//! cached before its publishers' replay buffers begin.
//!
//! Why: a ZMQ publisher keeps only its last batches for replay (vLLM: 10,000 steps). A
//! sidecar that starts after an engine has published more than that cannot learn, over
//! ZMQ, the blocks stored before the buffer's start; a hot system prompt cached an hour ago
//! would stay invisible to routing until evicted and stored again. With `state_file` set
//! the sidecar writes its caches every `checkpoint_interval_ms` (and on shutdown); on start
//! it reads them back and each stream resumes where the checkpoint left it: it asks its
//! publisher to replay from the checkpoint's last batch, and applies what follows only if
//! that batch is the one it applied (same sequence number, same payload digest). Anything
//! else (the engine restarted meanwhile, its buffer no longer reaches back, no replay
//! socket, no answer) clears the rank and rebuilds it as a fresh start would
//! (`resets_total{reason="restore_unverified"}`), so a checkpoint never adds a block the
//! engine does not hold.
//!
//! File: `MAGIC`, then the body, then the body's xxh3-64 (a torn or corrupt file is refused
//! whole). Body: block size (u32), record count (u32), and per worker a length-prefixed
//! record: id (u16 length + UTF-8), DP ranks (u64), per rank a resume point (u8 flag, seq
//! u64, payload digest u64), then the cache ([`crate::cache::WorkerCache::save`]). Integers
//! little-endian. A record is decoded only when its worker joins, so records of workers
//! that have not (yet) rejoined are carried over into later checkpoints unchanged.

use std::io::Write as _;
use std::path::Path;
use xxhash_rust::xxh3::xxh3_64;

const MAGIC: &[u8; 8] = b"KVRSTAT1";

/// The digest a resume point names its batch by.
pub fn payload_digest(payload: &[u8]) -> u64 {
    xxh3_64(payload)
}

/// Where a restored stream resumes: the last batch applied, and its payload's digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumePoint {
    pub seq: u64,
    pub digest: u64,
}

#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
}

/// Reads what a [`Writer`] wrote; every read checks the length first.
pub struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Reader<'a> {
        Reader { data }
    }
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.data.len() {
            return Err(format!("truncated: {n} bytes wanted, {} left", self.data.len()));
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, String> {
        self.array().map(u16::from_le_bytes)
    }
    pub fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }
    pub fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }
    /// A u64 count of elements of `size` bytes each, refused if the rest cannot hold them.
    pub fn count(&mut self, size: usize) -> Result<usize, String> {
        let n = self.u64()?;
        match usize::try_from(n) {
            Ok(n) if n <= self.data.len() / size.max(1) => Ok(n),
            _ => Err(format!("count {n} exceeds the {} bytes left", self.data.len())),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// A worker's record as saved, decoded when that worker joins.
#[derive(Debug)]
pub struct SavedWorker {
    pub id: String,
    pub record: Vec<u8>,
}

/// Wraps per-worker records (each from [`record_header`] plus its cache) into a file.
pub fn encode(block_size: u32, records: &[&[u8]]) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(8 + records.iter().map(|r| r.len() + 8).sum::<usize>()));
    w.u32(block_size);
    w.u32(records.len() as u32);
    for r in records {
        w.u64(r.len() as u64);
        w.bytes(r);
    }
    seal(&w.0)
}

/// A body as a file: the magic before it, its checksum after it.
pub fn seal(body: &[u8]) -> Vec<u8> {
    [&MAGIC[..], body, &xxh3_64(body).to_le_bytes()].concat()
}

/// Splits a checkpoint file into its workers' records; refused whole if it is not one, is
/// damaged, or was written for another block size.
pub fn decode(file: &[u8], block_size: u32) -> Result<Vec<SavedWorker>, String> {
    let body_len = file.len().checked_sub(MAGIC.len() + 8).ok_or("too short to be a checkpoint")?;
    if &file[..MAGIC.len()] != MAGIC {
        return Err("not a kvroute-sidecar checkpoint (or another version of it)".into());
    }
    let body = &file[MAGIC.len()..MAGIC.len() + body_len];
    let sum = u64::from_le_bytes(file[file.len() - 8..].try_into().map_err(|_| "checksum")?);
    if xxh3_64(body) != sum {
        return Err("checksum mismatch (a torn or damaged file)".into());
    }
    let mut r = Reader::new(body);
    let saved_block_size = r.u32()?;
    if saved_block_size != block_size {
        return Err(format!("written with block size {saved_block_size}, configured {block_size}"));
    }
    let n = r.u32()?;
    let mut out = Vec::new();
    for _ in 0..n {
        let len = r.count(1)?;
        let record = r.take(len)?;
        let mut rr = Reader::new(record);
        let id_len = usize::from(rr.u16()?);
        let id = std::str::from_utf8(rr.take(id_len)?).map_err(|_| "worker id is not UTF-8")?;
        out.push(SavedWorker { id: id.to_string(), record: record.to_vec() });
    }
    if !r.is_empty() {
        return Err("bytes after the last record".into());
    }
    Ok(out)
}

/// Starts a worker's record: its id, ranks and resume points (the cache follows).
pub fn record_header(w: &mut Writer, id: &str, points: &[Option<ResumePoint>]) {
    let id = &id.as_bytes()[..id.len().min(usize::from(u16::MAX))];
    w.u16(id.len() as u16);
    w.bytes(id);
    w.u64(points.len() as u64);
    for p in points {
        w.u8(u8::from(p.is_some()));
        let p = p.unwrap_or(ResumePoint { seq: 0, digest: 0 });
        w.u64(p.seq);
        w.u64(p.digest);
    }
}

/// Reads a record's header back: the resume point of each rank; the reader is left at the
/// cache.
pub fn read_header(r: &mut Reader<'_>) -> Result<Vec<Option<ResumePoint>>, String> {
    let id_len = usize::from(r.u16()?);
    r.take(id_len)?;
    let ranks = r.count(17)?;
    (0..ranks)
        .map(|_| {
            let (has, seq, digest) = (r.u8()?, r.u64()?, r.u64()?);
            Ok((has == 1).then_some(ResumePoint { seq, digest }))
        })
        .collect()
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, synced, then renamed
/// over it, so a crash mid-write leaves the previous checkpoint.
pub fn write_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_round_trip_and_damage_is_refused() {
        let mut a = Writer::default();
        record_header(&mut a, "10.0.0.1:8000", &[Some(ResumePoint { seq: 7, digest: 99 }), None]);
        let mut b = Writer::default();
        record_header(&mut b, "10.0.0.2:8000", &[None]);
        let file = encode(16, &[&a.0, &b.0]);
        let saved = decode(&file, 16).unwrap();
        assert_eq!(saved.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["10.0.0.1:8000", "10.0.0.2:8000"]);
        assert_eq!(saved[0].record, a.0);
        assert_eq!(
            read_header(&mut Reader::new(&saved[0].record)).unwrap(),
            [Some(ResumePoint { seq: 7, digest: 99 }), None]
        );
        assert!(decode(&file, 32).unwrap_err().contains("block size"));
        for cut in 0..file.len() {
            assert!(decode(&file[..cut], 16).is_err(), "cut {cut}");
        }
        for i in 0..file.len() {
            let mut bad = file.clone();
            bad[i] ^= 0x40;
            assert!(decode(&bad, 16).is_err(), "flipped byte {i}");
        }
    }

    #[test]
    fn a_count_the_rest_cannot_hold_is_refused() {
        let mut w = Writer::default();
        w.u64(u64::MAX);
        assert!(Reader::new(&w.0).count(24).is_err());
        let mut w = Writer::default();
        w.u64(2);
        w.bytes(&[0; 48]);
        assert_eq!(Reader::new(&w.0).count(24), Ok(2));
    }
}
