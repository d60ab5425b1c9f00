/**
 * One listening backend for a database, shared by every session that listens there (issue 50):
 * each channel is LISTENed on it once, and every notification Postgres sends it is handed on as it
 * comes. Its commands are LISTEN and UNLISTEN alone, one simple Query at a time, so it is never in a
 * transaction and never holds Postgres's notification queue back. `listen` resolves once Postgres
 * has registered the channel (its ReadyForQuery): a NOTIFY committed after that reaches it.
 *
 * A lost backend (terminated, the network, a restart) is reported at once (`onLost`: what was sent
 * meanwhile is gone, and those who listen must be told), then replaced by a new one that listens
 * again to every channel (`onRestored`).
 */
import { serialize } from 'pg-protocol'
import type { Upstream } from '../upstream/connection'
import { Framer } from '../wire/bytes'
import { ServerMessage } from '../wire/codes'
import { parseErrorFields } from '../wire/startup'
import { quoted } from '../isolation/verify'

export interface Notification {
  /** The sending backend's process ID, as Postgres gives it. */
  pid: number
  channel: string
  payload: string
  /** As the NotificationResponse its listeners are sent (proxy/notify/session-listening.ts). */
  bytes?: Buffer
}

/** What a hub listens through: a Listener here, or with --workers the primary's (proxy/cluster/listening.ts). */
export interface ListeningBackend {
  /** Resolves once Postgres has `channel` registered; rejects with its error (a `code` on it). */
  listen(channel: string): Promise<void>
  unlisten(channel: string): Promise<void>
  close(): void
}

export interface ListenerEvents {
  onNotification(n: Notification): void
  onLost(err: Error): void
  onRestored?(): void
}

/** A command sent, waiting for its ReadyForQuery; the error Postgres answered it with, if any. */
interface Command {
  done(err?: Error): void
  error?: Error
}

/** The listener's name in pg_stat_activity: its login's application_name, behind what it is. */
const NAMED = serialize.query("SELECT pg_catalog.set_config('application_name', 'edgepg-proxy listener: ' OPERATOR(pg_catalog.||) pg_catalog.current_setting('application_name'), false)")

export class Listener implements ListeningBackend {
  private upstream?: Promise<Upstream>
  /** The channels wanted, registered on every backend this listener has. */
  private readonly channels = new Set<string>()
  private readonly sent: Command[] = []
  /** A backend was lost: the next one listens again to every channel first. */
  private replacing = false
  private closed = false

  /** `login`: a backend logged in and ready for a query. */
  constructor(private readonly login: () => Promise<Upstream>, private readonly on: ListenerEvents) {}

  listen(channel: string): Promise<void> {
    this.channels.add(channel)
    return this.run(`LISTEN ${quoted(channel)}`)
  }

  unlisten(channel: string): Promise<void> {
    this.channels.delete(channel)
    return this.run(`UNLISTEN ${quoted(channel)}`)
  }

  async close() {
    this.closed = true
    const upstream = await this.upstream?.catch(() => undefined)
    upstream?.close()
  }

  private async run(sql: string): Promise<void> {
    const upstream = await (this.upstream ??= this.opening())
    return new Promise((resolve, reject) => {
      this.sent.push({ done: (err) => (err ? reject(err) : resolve()) })
      upstream.write(serialize.query(sql))
    })
  }

  /** A backend for a command: if Postgres refuses it, the next command tries again. */
  private opening(): Promise<Upstream> {
    const opening: Promise<Upstream> = this.open().catch((err) => {
      if (this.upstream === opening) this.upstream = undefined
      throw err
    })
    return opening
  }

  private async open(): Promise<Upstream> {
    const upstream = await this.login()
    const framer = new Framer()
    const read = (chunk: Buffer) => framer.each(chunk, (bytes, start, end) => this.message(bytes, start, end))
    read(upstream.relay(read))
    upstream.on('error', () => {}) // (its close follows, which says it)
    upstream.on('close', () => this.lost(upstream))
    this.sent.push({ done: () => {} })
    upstream.write(NAMED)
    // A replacement listens again to every channel, ahead of any command of its own.
    if (this.replacing && this.channels.size) {
      this.sent.push({ done: (err) => (err ? upstream.close() : ((this.replacing = false), this.on.onRestored?.())) })
      upstream.write(serialize.query([...this.channels].map((c) => `LISTEN ${quoted(c)}`).join('; ')))
    }
    return upstream
  }

  private message(bytes: Buffer, start: number, end: number) {
    const type = bytes[start]
    if (type === ServerMessage.NotificationResponse) {
      const pid = bytes.readInt32BE(start + 5)
      const channelEnd = bytes.indexOf(0, start + 9)
      const payloadEnd = bytes.indexOf(0, channelEnd + 1)
      this.on.onNotification({ pid, channel: bytes.toString('utf8', start + 9, channelEnd), payload: bytes.toString('utf8', channelEnd + 1, Math.min(payloadEnd, end)) })
    } else if (type === ServerMessage.ErrorResponse && this.sent.length) {
      const { code, message } = parseErrorFields(bytes.subarray(start + 5, end))
      this.sent[0].error = Object.assign(new Error(message), { code })
    } else if (type === ServerMessage.ReadyForQuery) {
      const command = this.sent.shift()
      command?.done(command.error)
    }
  }

  private lost(upstream: Upstream) {
    if (this.upstream === undefined) return
    this.upstream = undefined
    const err = new Error(`edgepg-proxy's listening connection to Postgres (${upstream.name}) was lost: notifications sent meanwhile were not delivered`)
    for (const command of this.sent.splice(0)) command.done(err)
    if (this.closed) return // (closed on purpose: nothing was lost)
    this.replacing = true
    this.on.onLost(err)
    this.reopen(100)
  }

  /** A new backend for the channels, tried again (twice as late each time, up to 5 s) while Postgres refuses it. */
  private reopen(delayMs: number) {
    if (this.closed || !this.channels.size || this.upstream) return
    const again = (this.upstream = this.open())
    again.catch(() => {
      if (this.upstream !== again) return
      this.upstream = undefined
      setTimeout(() => this.reopen(Math.min(2 * delayMs, 5000)), delayMs).unref()
    })
  }
}

