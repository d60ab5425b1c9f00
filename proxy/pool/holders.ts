/**
 * Who each backend of a key is lent to, for --max-backends-per-client: the client (a token's subject,
 * else its address) and how many each holds now (parked backends not counted: another may take them).
 */
import type { Backend } from './backends'

/** Who a backend is lent to, for the per-client share (none: not counted, as a /sql request). */
export interface Holder {
  /** A token's subject, else the client's address. */
  client: string
  /** Whether it sits idle inside a transaction now: then it may be ended for another client's sake. */
  idleInTransaction(): boolean
  /** Ends the session (its transaction rolled back), naming the flag. */
  evict(message: string): void
}

/** Who each lent backend is lent to, and how many each client holds (parked ones not counted). */
export class Holders {
  private readonly by = new Map<Backend, { holder: Holder; counted: boolean }>()
  private readonly held = new Map<string, number>()

  set(backend: Backend, holder: Holder | undefined) {
    this.delete(backend)
    if (!holder) return
    this.by.set(backend, { holder, counted: true })
    this.add(holder.client, 1)
  }

  /** A holder idle inside a transaction whose client holds more than `share`, other than `client`. */
  over(share: number, client: string | undefined): Holder | undefined {
    if (this.held.size === (client !== undefined && this.held.has(client) ? 1 : 0)) return undefined // (no other client holds any)
    for (const { holder, counted } of this.by.values()) {
      if (counted && holder.client !== client && this.count(holder.client) > share && holder.idleInTransaction()) return holder
    }
    return undefined
  }

  delete(backend: Backend) {
    const holder = this.by.get(backend)
    if (!holder) return
    this.by.delete(backend)
    if (holder.counted) this.add(holder.holder.client, -1)
  }

  counted(backend: Backend, counted: boolean) {
    const holder = this.by.get(backend)
    if (!holder || holder.counted === counted) return
    holder.counted = counted
    this.add(holder.holder.client, counted ? 1 : -1)
  }

  count(client: string): number {
    return this.held.get(client) ?? 0
  }

  private add(client: string, n: number) {
    const now = this.count(client) + n
    if (now) this.held.set(client, now)
    else this.held.delete(client)
  }
}
