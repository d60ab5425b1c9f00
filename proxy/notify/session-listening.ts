/**
 * A pooled session's LISTEN channels (issue 50): registered with its key's hub (one listening
 * backend for all), so that the session holds no backend between statements. The channels are
 * Postgres's account of the session after each transaction that may have changed them
 * (pg_listening_channels(), proxy/pool/lent-handover.ts), and every backend it borrows listens on
 * them again (proxy/pool/session-state.ts), so that Postgres answers for the session there.
 *
 * What the session hears comes from the hub, as Postgres delivers it: not while the session is in
 * a transaction or running something (held, then sent), with a processID naming no backend (0);
 * but what the session sent itself arrives on its own backend, before its commit's ReadyForQuery as
 * on a connection of its own, with the session's processID, and the hub's copy of it is dropped.
 */
import type { Hub, Subscriber } from './hub'
import type { Notification } from './listener'
import { ServerMessage } from '../wire/codes'
import { errorResponse } from '../wire/startup'

export interface ListeningHost {
  /** The processID the session was told. */
  readonly pid: number
  /** Nothing of the session's runs, and it is not inside a transaction: Postgres would deliver now. */
  idle(): boolean
  /** `shared`: the same Buffer goes to other sessions too. */
  toClient(bytes: Buffer, shared?: boolean): void
  /** Bytes the client has still to take. */
  readonly unsent: number
  evict(code: string, message: string): void
}

/** Whether a token session may listen on a channel: true, or why not (proxy/notify/policy.ts). */
export type ListenPolicy = (channel: string) => Promise<true | string>

/** What a change of channels came to: the channels not listened on, each with why (Postgres's code and words). */
export type Refusals = { channel: string; code: string; message: string }[]

/** A session's own notifications heard on its backend, whose hub copies are still to come (bounded: a copy may never come). */
const ECHOES_MAX = 1000

export class SessionListening implements Subscriber {
  private readonly hubChannels = new Set<string>()
  /** Notifications held while the session is busy, and their bytes. */
  private notes: { n: Notification; msg: Buffer }[] = []
  private noted = 0
  private readonly echoes: Notification[] = []
  /** Channels the policy allowed (true) or refused (why), per session. */
  private decided?: Map<string, true | string>

  /** `limit`: the bytes of notifications a session may fall behind by before it is closed (--listen-buffer). */
  constructor(private readonly hub: Hub, private readonly host: ListeningHost, private readonly limit: number, private readonly policy?: ListenPolicy) {}

  get channels(): ReadonlySet<string> {
    return this.hubChannels
  }

  /**
   * Postgres's account of the session's channels after a transaction (pg_listening_channels()):
   * the new ones registered with the hub (their LISTEN answered there) or refused, the gone ones
   * dropped. Resolves with what was refused; the session listens on `channels` less those.
   */
  async update(channels: string[]): Promise<Refusals> {
    const wanted = new Set(channels)
    for (const channel of this.hubChannels) if (!wanted.has(channel)) this.hubChannels.delete(channel), this.hub.unsubscribe(this, channel)
    const refusals: Refusals = []
    await Promise.all(
      channels
        .filter((c) => !this.hubChannels.has(c))
        .map(async (channel) => {
          const allowed = await this.allowed(channel)
          if (allowed !== true) return void refusals.push({ channel, code: '42501', message: allowed })
          try {
            await this.hub.subscribe(this, channel)
            if (this.over) this.hub.unsubscribe(this, channel) // (the session ended meanwhile)
            else this.hubChannels.add(channel)
          } catch (err) {
            const { code = '08006', message } = err as Error & { code?: string }
            refusals.push({ channel, code, message: `edgepg-proxy could not listen on "${channel}": ${message}` })
          }
        })
    )
    return refusals
  }

  /** The policy's decision, kept for the session; a policy that could not decide refuses this once. */
  private async allowed(channel: string): Promise<true | string> {
    if (!this.policy) return true
    const known = this.decided?.get(channel)
    if (known !== undefined) return known
    try {
      const decision = await this.policy(channel)
      ;(this.decided ??= new Map()).set(channel, decision)
      return decision
    } catch (err) {
      return `permission denied to listen on "${channel}": ${(err as Error).message}`
    }
  }

  /**
   * A notification on the session's own backend (it listens there too: see above): the session's
   * own, with its processID; another's is the hub's to deliver.
   */
  fromBackend(msg: Buffer, backendPid: number): Buffer | false {
    const n = parse(msg)
    if (n.pid !== backendPid) return false
    if (this.hubChannels.has(n.channel)) {
      // (Its hub copy is held here already, or still to come.)
      const early = this.notes.findIndex((e) => same(e.n, n))
      if (early >= 0) this.noted -= this.notes.splice(early, 1)[0].msg.length
      else if (this.echoes.push(n) > ECHOES_MAX) this.echoes.shift()
    }
    return message(this.host.pid, n.channel, n.payload)
  }

  notify(n: Notification) {
    const echo = this.echoes.findIndex((e) => same(e, n))
    if (echo >= 0) return void this.echoes.splice(echo, 1)
    const msg = (n.bytes ??= message(0, n.channel, n.payload)) // (made once for all its listeners)
    if (!this.notes.length && this.host.idle()) return this.send(msg, true)
    this.notes.push({ n, msg })
    this.noted += msg.length
    this.bounded()
  }

  /** The session is idle: what was held goes. */
  flush() {
    if (!this.notes.length || !this.host.idle()) return
    const msgs = this.notes.map((e) => e.msg)
    this.notes = []
    this.noted = 0
    this.send(msgs.length === 1 ? msgs[0] : Buffer.concat(msgs))
  }

  private send(bytes: Buffer, shared = false) {
    this.host.toClient(bytes, shared)
    this.bounded()
  }

  /** A session too slow to take its notifications is closed, not waited for: the hub serves every session at once. */
  private bounded() {
    const behind = this.noted + this.host.unsent
    if (behind > this.limit) this.host.evict('53400', `edgepg-proxy: the session fell ${behind} bytes behind its notifications, over --listen-buffer (${this.limit}): closed so that no other listener waits for it`)
  }

  lost(err: Error) {
    this.echoes.length = 0 // (their copies went with the backend)
    this.host.toClient(errorResponse('08006', `${err.message}; LISTEN ${[...this.hubChannels].join(', ')} is being registered again`, 'WARNING'))
  }

  restored() {
    this.host.toClient(errorResponse('00000', `edgepg-proxy listens again on ${[...this.hubChannels].join(', ')}: notifications committed from now on are delivered`, 'NOTICE'))
  }

  private over = false

  /** The session is over. */
  end() {
    this.over = true
    for (const channel of this.hubChannels) this.hub.unsubscribe(this, channel)
    this.hubChannels.clear()
    this.notes = []
  }
}

function parse(msg: Buffer): Notification {
  const channelEnd = msg.indexOf(0, 9)
  return { pid: msg.readInt32BE(5), channel: msg.toString('utf8', 9, channelEnd), payload: msg.toString('utf8', channelEnd + 1, msg.length - 1) }
}

const same = (a: Notification, b: Notification) => a.pid === b.pid && a.channel === b.channel && a.payload === b.payload

/** A NotificationResponse. */
function message(pid: number, channel: string, payload: string): Buffer {
  const c = Buffer.byteLength(channel)
  const p = Buffer.byteLength(payload)
  const msg = Buffer.allocUnsafe(11 + c + p)
  msg[0] = ServerMessage.NotificationResponse
  msg.writeInt32BE(10 + c + p, 1)
  msg.writeInt32BE(pid, 5)
  msg.write(channel, 9)
  msg[9 + c] = 0
  msg.write(payload, 10 + c)
  msg[10 + c + p] = 0
  return msg
}
