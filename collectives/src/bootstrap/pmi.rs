//! A client for PMI-1, the text protocol MPICH's launcher (hydra) speaks to
//! each rank over the socket in `PMI_FD`: enough to publish rank 0's
//! rendezvous address in the job's key-value space and read it everywhere,
//! without linking MPI.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// An initialised PMI-1 connection. Hydra takes a PMI socket that closes
/// before `finalize` for a dead process and kills the job: call
/// [`finalize`](Self::finalize) when done.
pub struct Pmi {
    reader: BufReader<UnixStream>,
    kvs: String,
}

impl Pmi {
    /// Takes over the launcher's socket `fd` and says hello.
    pub fn connect(fd: RawFd, timeout: Duration) -> Result<Self, String> {
        // SAFETY: PMI_FD names a socket the launcher opened for this process
        // and nobody else in it uses; we take it over for good.
        let stream = unsafe { UnixStream::from_raw_fd(fd) };
        stream
            .set_read_timeout(Some(timeout))
            .map_err(|e| format!("PMI_FD={fd} is not a socket: {e}"))?;
        let mut pmi = Pmi {
            reader: BufReader::new(stream),
            kvs: String::new(),
        };
        let init = pmi.call(
            "cmd=init pmi_version=1 pmi_subversion=1",
            "response_to_init",
        )?;
        if init.get("rc").map(String::as_str) != Some("0") {
            return Err(format!("the launcher refused PMI-1: {init:?}"));
        }
        pmi.kvs = pmi
            .call("cmd=get_my_kvsname", "my_kvsname")?
            .remove("kvsname")
            .ok_or("no kvsname")?;
        Ok(pmi)
    }

    pub fn put(&mut self, key: &str, value: &str) -> Result<(), String> {
        let reply = self.call(
            &format!("cmd=put kvsname={} key={key} value={value}", self.kvs),
            "put_result",
        )?;
        match reply.get("rc").map(String::as_str) {
            Some("0") => Ok(()),
            _ => Err(format!("PMI put of {key} failed: {reply:?}")),
        }
    }

    /// Waits until every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<(), String> {
        self.call("cmd=barrier_in", "barrier_out").map(drop)
    }

    pub fn get(&mut self, key: &str) -> Result<String, String> {
        let mut reply = self.call(
            &format!("cmd=get kvsname={} key={key}", self.kvs),
            "get_result",
        )?;
        match reply.get("rc").map(String::as_str) {
            Some("0") => reply
                .remove("value")
                .ok_or_else(|| format!("PMI get of {key}: no value")),
            _ => Err(format!("PMI has no {key}: {reply:?}")),
        }
    }

    /// Tells the launcher this process is done with PMI (it may then exit
    /// normally) and closes the socket.
    pub fn finalize(mut self) -> Result<(), String> {
        self.call("cmd=finalize", "finalize_ack").map(drop)
    }

    /// Sends one command line, reads the reply line for `expect`.
    fn call(&mut self, line: &str, expect: &str) -> Result<HashMap<String, String>, String> {
        let stream = self.reader.get_mut();
        stream
            .write_all(format!("{line}\n").as_bytes())
            .map_err(|e| format!("PMI: cannot talk to the launcher: {e}"))?;
        let mut reply = String::new();
        self.reader
            .read_line(&mut reply)
            .map_err(|e| format!("PMI: no answer from the launcher: {e}"))?;
        parse_reply(&reply, expect)
    }
}

/// A PMI-1 reply line's `key=value` fields, if its `cmd` is `expect`.
pub(crate) fn parse_reply(reply: &str, expect: &str) -> Result<HashMap<String, String>, String> {
    let fields: HashMap<String, String> = reply
        .split_whitespace()
        .filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    match fields.get("cmd") {
        Some(c) if c == expect => Ok(fields),
        _ => Err(format!(
            "PMI: expected {expect}, the launcher said {:?}",
            reply.trim()
        )),
    }
}
