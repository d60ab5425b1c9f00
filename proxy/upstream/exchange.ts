import type { Upstream } from './connection'
import { Framer } from '../wire/bytes'
import { ServerMessage, TxStatus } from '../wire/codes'
import { parseErrorFields } from '../wire/startup'

/** What Postgres answered the proxy's own messages: its first error, if any, whether it was left idle, and the first row's first value. */
export interface Answer {
  error?: { code: string; message: string }
  idle: boolean
  first?: string
}

/**
 * Sends `bytes` (the proxy's own, ending in one Sync or Query) on an idle backend, and reads
 * Postgres's answers through its ReadyForQuery. Undefined when the connection closes first.
 */
export function exchange(upstream: Upstream, bytes: Buffer): Promise<Answer | undefined> {
  return new Promise((resolve) => {
    const framer = new Framer()
    let error: Answer['error']
    let first: string | undefined
    const take = (chunk: Buffer) => {
      for (const m of framer.push(chunk)) {
        if (m[0] === ServerMessage.ErrorResponse) error ??= parseErrorFields(m.subarray(5))
        if (m[0] === ServerMessage.DataRow && first === undefined && m.readInt16BE(5) > 0 && m.readInt32BE(7) >= 0) first = m.toString('utf8', 11, 11 + m.readInt32BE(7))
        if (m[0] === ServerMessage.ReadyForQuery) return finish({ error, idle: m[5] === TxStatus.Idle, first })
      }
    }
    const onClose = () => finish(undefined)
    const finish = (answer: Answer | undefined) => {
      upstream.off('close', onClose)
      resolve(answer)
    }
    if (upstream.gone) return finish(undefined)
    upstream.on('close', onClose)
    const early = upstream.relay(take)
    if (early.length) take(early)
    upstream.resume()
    upstream.write(bytes)
  })
}
