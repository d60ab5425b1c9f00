// Names the Postgres protocol messages in a stream of WebSocket frames. A message may span frames
// (the proxy relays TCP chunks as they come), so each direction keeps a reader with its own state.

const FRONTEND = {
  p: 'PasswordMessage', Q: 'Query', P: 'Parse', B: 'Bind', D: 'Describe', E: 'Execute', S: 'Sync',
  H: 'Flush', C: 'Close', X: 'Terminate', d: 'CopyData', c: 'CopyDone', f: 'CopyFail', F: 'FunctionCall',
}
const BACKEND = {
  R: 'Authentication', S: 'ParameterStatus', K: 'BackendKeyData', Z: 'ReadyForQuery', T: 'RowDescription',
  D: 'DataRow', C: 'CommandComplete', E: 'ErrorResponse', N: 'NoticeResponse', 1: 'ParseComplete',
  2: 'BindComplete', 3: 'CloseComplete', n: 'NoData', s: 'PortalSuspended', I: 'EmptyQueryResponse',
  t: 'ParameterDescription', A: 'NotificationResponse', G: 'CopyInResponse', H: 'CopyOutResponse',
  W: 'CopyBothResponse', d: 'CopyData', c: 'CopyDone', v: 'NegotiateProtocolVersion',
}
const AUTH = {
  0: 'AuthenticationOk', 2: 'AuthenticationKerberosV5', 3: 'AuthenticationCleartextPassword', 5: 'AuthenticationMD5Password',
  7: 'AuthenticationGSS', 9: 'AuthenticationSSPI', 10: 'AuthenticationSASL', 11: 'AuthenticationSASLContinue', 12: 'AuthenticationSASLFinal',
}
/** The untagged first messages a client may send: length, then one of these codes. */
const UNTAGGED = { 196608: 'StartupMessage', 80877103: 'SSLRequest', 80877102: 'CancelRequest', 80877104: 'GSSENCRequest' }

/**
 * A reader for one direction ('frontend': what the client sends, 'backend': what it receives):
 * give it each frame's bytes in order, it returns the names of the messages that start in it.
 */
export function protocolReader(side) {
  // The client's first message (StartupMessage) has no tag byte: length (4), protocol code (4).
  let untagged = side === 'frontend'
  let head = [] // header bytes of the message being read
  let skip = 0 // bytes of the current message's body still to come
  return (bytes) => {
    const names = []
    let i = 0
    while (i < bytes.length) {
      if (skip > 0) {
        const n = Math.min(skip, bytes.length - i)
        skip -= n
        i += n
        continue
      }
      head.push(bytes[i++])
      const tag = untagged ? '' : String.fromCharCode(head[0])
      // Authentication carries its kind right after the length: read it to name the message.
      const need = untagged ? 8 : side === 'backend' && tag === 'R' ? 9 : 5
      if (head.length < need) continue
      const int = (at) => new DataView(Uint8Array.from(head.slice(at, at + 4)).buffer).getInt32(0)
      if (untagged) {
        const code = int(4)
        names.push(UNTAGGED[code] ?? 'StartupMessage')
        skip = int(0) - 8
        untagged = code === 80877103 // after an SSLRequest comes TLS, then the StartupMessage again
      } else {
        const table = side === 'frontend' ? FRONTEND : BACKEND
        names.push(tag === 'R' && side === 'backend' ? AUTH[int(5)] ?? 'Authentication' : table[tag] ?? `'${tag}'`)
        skip = int(1) - (need - 1)
      }
      head = []
    }
    return names
  }
}

/** "ParameterStatus, ParameterStatus, DataRow" → ["ParameterStatus ×2", "DataRow"]. */
export function collapse(names) {
  const out = []
  for (const name of names) {
    const last = out[out.length - 1]
    if (last && last.name === name) last.n++
    else out.push({ name, n: 1 })
  }
  return out.map(({ name, n }) => (n > 1 ? `${name} ×${n}` : name))
}
