import type { Upstream } from './connection'
import { Framer } from '../wire/bytes'
import { ServerMessage, TxStatus } from '../wire/codes'
import { parseErrorFields } from '../wire/startup'

/** What Postgres answered the proxy's own messages: its first error, if any, and whether it was left idle. */
export interface Answer {
  error?: { code: string; message: string }
  idle: boolean
}

/**
 * Sends `bytes` (the proxy's own, ending in one Sync or Query) on an idle backend, and reads
 * Postgres's answers through its ReadyForQuery. Undefined when the connection closes first.
 */
export function exchange(upstream: Upstream, bytes: Buffer): Promise<Answer | undefined> {
  return new Promise((resolve) => {
    const framer = new Framer()
    let error: Answer['error']
    const take = (chunk: Buffer) => {
      for (const m of framer.push(chunk)) {
        if (m[0] === ServerMessage.ErrorResponse) error ??= parseErrorFields(m.subarray(5))
        if (m[0] === ServerMessage.ReadyForQuery) return finish({ error, idle: m[5] === TxStatus.Idle })
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
